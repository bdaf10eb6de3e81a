"""k3engine: the Kimi K3 engine (C core via cffi), its numpy oracle and checkpoint tools."""
