"""The container backend's settings: a renamed one still works, a misspelt one does not."""

import logging

import pytest
from dsec_backend_container.backend import ContainerConfig
from pydantic import ValidationError


def test_a_renamed_setting_is_taken_as_its_new_name_with_a_warning(caplog):
    # (DSEC_BACKEND_CONFIG__CONTAINER__EGRESS_BRIDGE, set for an earlier release, had stopped
    # every edge with "Extra inputs are not permitted")
    with caplog.at_level(logging.WARNING):
        config = ContainerConfig.model_validate({"egress_bridge": "x"})
    assert config.egress_name == "x"
    assert "egress_bridge is now egress_name" in caplog.text
    assert (
        ContainerConfig.model_validate({"egress_bridge": "x", "egress_name": "y"}).egress_name
        == "y"
    )


def test_a_setting_no_release_had_is_refused():
    with pytest.raises(ValidationError, match="egress_brige"):
        ContainerConfig.model_validate({"egress_brige": "x"})
