"""The store: the pure table (:mod:`.table`: every mutation rule, no asyncio; :mod:`.checks`:
what each parameter must be) and its single writer (:mod:`.writer`: asyncio queues and
futures, no sockets).

Import the module you need: ``aioparamsync.store.table`` loads no asyncio.
"""
