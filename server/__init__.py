"""The HTTP server's parts: OpenAI's wire format, the Responses API, per-request limits, the
engine's thread, tool calls, gpt-oss's harmony format, constraint checks and tensor-parallel
engine loading. serve.py (at the root) wires them to the engine; the core never imports them.
"""
