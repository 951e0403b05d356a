"""tandem's router: an asyncio HTTP proxy in front of prefill/decode (or colocated) engines.

It imports neither torch nor the engine: it runs in a small image with no accelerator stack.
"""
