"""DSec fncall backend: stateless calls from a warm pool of pre-isolated workers.

Kept import-light: the zygote imports this package in a minimal interpreter. The backend
class lives in :mod:`dsec_backend_fncall.backend`.
"""
