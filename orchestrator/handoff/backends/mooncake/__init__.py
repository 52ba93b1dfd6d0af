"""The engine route: Mooncake's TransferEngine (engine), the send path over it (router), its
send_probe (probe) and the process's backend (backend)."""
