"""The PD fields of a request body: one `Bootstrap` per prompt from scalars or per-prompt lists, nothing on a
unified server, and a client-facing ValueError (the routes' 400) for everything a PD server cannot take."""

from __future__ import annotations

import pytest

from tokenloom.disaggregation.bootstrap_fields import bootstraps_for
from tokenloom.protocol import Bootstrap


def test_a_unified_server_ignores_the_fields_whatever_they_hold():
    assert bootstraps_for("null", "x", "not a port", [1, 2, 3], count=2, copies=4) == [None, None]


def test_scalars_apply_to_every_prompt_and_lists_go_per_prompt():
    assert bootstraps_for("decode", "10.0.0.1", 8998, 7, count=1, copies=1) == [Bootstrap("10.0.0.1", 8998, 7)]
    got = bootstraps_for("prefill", ["a", "b"], 8998, [5, 6], count=2, copies=1)
    assert got == [Bootstrap("a", 8998, 5), Bootstrap("b", 8998, 6)]


def test_sglangs_fake_host_needs_no_port():
    assert bootstraps_for("decode", "2.2.2.2", None, 9, count=1, copies=1)[0].is_fake


@pytest.mark.parametrize("host, port, room, count, copies, match", [
    ("h", 1, None, 1, 1, "bootstrap_room is required on a disaggregated"),
    (None, 1, 5, 1, 1, "bootstrap_host is required"),
    ("h", 1, [1, 2, 3], 2, 1, "bootstrap_room has 3 entries for 2 prompts"),
    ("h", 1, 5, 1, 2, "n > 1 is not supported"),
    ("h", 70000, 5, 1, 1, "bootstrap_port must be a port number"),
    ("h", True, 5, 1, 1, "bootstrap_port must be a port number"),
    ("h", 1, -1, 1, 1, r"bootstrap_room must be an integer in \[0, 2\*\*63\)"),
    ("h", 1, 2**63, 1, 1, "bootstrap_room must be an integer"),
    ("h", 1, "5", 1, 1, "bootstrap_room must be an integer"),
    ("", 1, 5, 1, 1, "bootstrap_host must be a host name"),
    ("h", 1, [4, 4], 2, 1, "must differ between the prompts"),
])
def test_what_a_pd_server_refuses(host, port, room, count, copies, match):
    with pytest.raises(ValueError, match=match):
        bootstraps_for("decode", host, port, room, count, copies)
