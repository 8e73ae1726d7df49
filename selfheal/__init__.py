"""The engine watchdog: notices a ``target`` or ``draft`` that can no longer
serve (its process died, or it stopped answering) and reloads it through
Triton's model-repository API, so a replica heals without a person
(docs/reference.md, "Self-healing")."""
