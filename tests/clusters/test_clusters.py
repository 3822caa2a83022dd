"""Every cluster-launcher file in clusters/ passes Ray's own config validation, offline (no cloud calls):
`prepare_config` (the launcher's defaults for the provider) then `validate_config` (ray-schema.json plus the
head-node-type and min/max-worker checks). Broken variants must be rejected."""

from __future__ import annotations

import copy
import glob
import os
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_FILES = sorted(glob.glob(str(ROOT / "clusters" / "*.yaml")))
INSTALL = "python3.11 -m venv .venv) && .venv/bin/pip install -r requirements.txt && .venv/bin/pip install -e . --no-deps"


def ray_validate(config: dict) -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def load(path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def test_cluster_files_exist():
    names = {os.path.basename(p) for p in CLUSTER_FILES}
    assert {"aws.yaml", "local.yaml"} <= names


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=os.path.basename)
def test_cluster_file_validates(path):
    config = load(path)
    prepared = ray_validate(config)
    assert prepared["head_node_type"] in prepared["available_node_types"]
    # the nodes install this project the way the README does, from the synced repository
    assert config["file_mounts"] == {"~/raysim": "."}
    setup = " ; ".join(config["setup_commands"])
    assert INSTALL in setup and "cd ~/raysim" in setup
    assert any("ray start --head" in c for c in config["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in config["worker_start_ray_commands"])


def test_aws_has_autoscaling_gpu_workers():
    config = load(ROOT / "clusters" / "aws.yaml")
    assert config["provider"]["type"] == "aws"
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    gpu = [v for v in workers.values() if v["resources"].get("GPU", 0) >= 1]
    assert gpu and all(v.get("min_workers", 0) < v["max_workers"] for v in gpu)
    assert all(v["node_config"]["InstanceType"].startswith(("g", "p")) for v in gpu)


def _aws():
    return load(ROOT / "clusters" / "aws.yaml")


def _misspelt_top_level(c):
    c["max_worker"] = c.pop("max_workers")


def _misspelt_node_type_key(c):
    c["available_node_types"]["ray.worker.gpu"]["min_worker"] = c["available_node_types"]["ray.worker.gpu"].pop("min_workers")


def _unknown_head_node_type(c):
    c["head_node_type"] = "ray.head.gpu"


def _missing_resources_type(c):
    c["available_node_types"]["ray.worker.gpu"]["resources"] = {"GPU": "one"}


def _min_workers_over_max(c):
    c["max_workers"] = 0
    c["available_node_types"]["ray.worker.gpu"]["min_workers"] = 2


def _command_not_a_string(c):
    # the classic YAML slip: an unquoted `: ` turns a command into a mapping
    c["worker_start_ray_commands"].append(yaml.safe_load("- ray start --resources={\"w\": 1}")[0])


@pytest.mark.parametrize(
    "mutate, error",
    [
        (_misspelt_top_level, "'max_worker' was unexpected"),
        (_misspelt_node_type_key, "'min_worker' was unexpected"),
        (_unknown_head_node_type, "head_node_type` must be one of `available_node_types"),
        (_missing_resources_type, "is not of type 'integer'"),
        (_min_workers_over_max, "max_workers"),
        (_command_not_a_string, "is not of type 'string'"),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else "",
)
def test_broken_variants_are_rejected(mutate, error):
    import jsonschema

    config = _aws()
    mutate(config)
    with pytest.raises((jsonschema.ValidationError, ValueError)) as info:
        ray_validate(config)
    assert error in str(info.value)


def test_local_provider_rejects_node_types():
    # the local provider builds its own single node type; a config that names its own is refused
    config = load(ROOT / "clusters" / "local.yaml")
    config["available_node_types"] = {"x": {"resources": {}, "node_config": {}}}
    import click

    with pytest.raises(click.ClickException, match="available_node_types is not supported"):
        ray_validate(config)
