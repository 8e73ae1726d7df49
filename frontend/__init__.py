"""An OpenAI-compatible HTTP API in front of the coordinator.

Pure modules (``errors``, ``requests``, ``responses``) turn OpenAI request JSON
into coordinator inputs and the coordinator's responses into OpenAI bodies,
chunks and errors, and are tested in milliseconds; thin adapters do the I/O:
``coordinator_client`` (gRPC streaming to Triton), ``prompts`` (the chat
template and the prompt token count) and ``openai_server`` (FastAPI and
uvicorn)."""
