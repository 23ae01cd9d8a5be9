"""The cluster: membership, placement (the one function that says who holds a key),
replica links and repair."""
