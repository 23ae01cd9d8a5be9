"""Pure helpers both sides of a routed call share: below the client and the server.

The node passing parts of a call on and the client routing them itself cut and
merge them alike: :mod:`.partitions` cuts large parameters into their
partitions and puts them together; :mod:`.merge` cuts a read into parts and
merges the parts' answers. Nothing here opens a socket or knows a cluster.
"""
