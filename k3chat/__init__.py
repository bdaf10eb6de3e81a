"""k3chat: private, local chat with Kimi K3 in the terminal."""

__version__ = "0.1.0"
