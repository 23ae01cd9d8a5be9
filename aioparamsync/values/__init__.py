"""Values: arrays on the wire (dtype, shape, zero-copy), compression, gradient rules, pieces.

Pure numpy over the wire's types: no asyncio, no sockets. Import the module
you need (``aioparamsync.values.arrays``, ``.compression``, ``.rules``,
``.pieces``).
"""
