"""The k3chat Textual app (design section 4). Only this package imports Textual."""

from .app import AppUsageError, K3ChatApp, build_app

__all__ = ["K3ChatApp", "build_app", "AppUsageError"]
