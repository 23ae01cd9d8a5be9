"""The node's server side: the asyncio transport, the IDL's handlers, gradients, long polls."""
