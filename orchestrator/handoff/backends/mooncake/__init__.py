"""The engine route: Mooncake's TransferEngine (engine), a batch's completion asked without
waiting (completion), the send path over it (router), its send_probe (probe) and the process's
backend (backend)."""
