"""The two helpers of vLLM's network_utils grpokit's server engine uses (CPU stand-in)."""

import socket


def get_ip() -> str:
    return "127.0.0.1"


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
