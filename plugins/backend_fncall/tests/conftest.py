import pytest
from dsec_backend_fncall.backend import FncallBackend

REASON = FncallBackend.unavailable_reason()


def pytest_collection_modifyitems(items):
    if REASON:
        for item in items:
            if "backend_fncall" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=f"fncall cannot run here: {REASON}"))
