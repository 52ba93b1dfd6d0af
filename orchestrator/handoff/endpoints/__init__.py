"""The two processes of a handoff: prefill (sender) and decode (receiver)."""
