"""DSec container backend: namespaced Linux sandboxes on shared read-only layers.

The backend class is :class:`dsec_backend_container.backend.ContainerBackend`.
"""
