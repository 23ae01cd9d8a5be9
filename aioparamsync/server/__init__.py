"""The node's server side.

The asyncio transport, call dispatch and reply order, the IDL's handlers, gradient pushes, long
polls and barriers.
"""
