"""The `user@` part of a host is a plain user name: no shell word can hide in it."""

from __future__ import annotations

import json

import pytest

from dtrain.cluster.spec import ClusterSpec, load_cluster
from dtrain.errors import ConfigError

HOSTILE_USERS = ["a;touch${IFS}x", "$(id)", "`id`", "u|v", "u&v", "u>f", "-oProxyCommand=x", "u'v", 'u"v',
                 "u\\v", "u*", "u?", "u!", "u(v)", "u{v}", "u~", ".u"]


@pytest.mark.parametrize("user", HOSTILE_USERS)
def test_hostile_user_is_refused_in_hosts_and_cluster_files(tmp_path, user):
    with pytest.raises(ConfigError, match="SSH destination"):
        ClusterSpec.from_hosts([f"{user}@gpu1"])
    path = tmp_path / "cluster.yaml"
    path.write_text("nodes:\n  - host: " + json.dumps(f"{user}@gpu1") + "\n")  # JSON is YAML
    with pytest.raises(ConfigError, match="SSH destination"):
        load_cluster(path)


def test_ordinary_users_are_accepted():
    hosts = ["ubuntu@gpu1", "svc_train@gpu2", "first.last@gpu3", "ops-1@gpu4", "ssh://_ci@10.0.0.7:2222"]
    assert [n.host for n in ClusterSpec.from_hosts(hosts).nodes] == hosts
