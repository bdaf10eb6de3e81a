"""Textual stylesheets and theme definitions shipped with k3chat."""
