"""The handoff: MetadataBuffers and their digest, the transports (Mooncake engine, ZMQ route),
the prefill and decode endpoints, and the runner that starts them (app: one job)."""
