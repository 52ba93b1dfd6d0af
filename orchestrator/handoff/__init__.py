"""The handoff, the byte path: MetadataBuffers and their digest, the backends that carry the
rows (Mooncake engine, ZMQ route) and the prefill and decode endpoints that move and judge the
aux rows."""
