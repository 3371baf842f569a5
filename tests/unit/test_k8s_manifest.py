"""deploy/rayservice.yaml, validated offline: the RayService fields KubeRay documents (a JSON
schema written from them), and the embedded serve config equal to serve_config.yaml's."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())


def test_manifest_matches_the_rayservice_schema():
    schema = json.loads((ROOT / "deploy" / "rayservice.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(MANIFEST, schema)


def test_embedded_serve_config_is_the_repository_config():
    embedded = yaml.safe_load(MANIFEST["spec"]["serveConfigV2"])
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    assert embedded["applications"] == config["applications"]
    assert embedded["http_options"]["port"] == config["http_options"]["port"] == 8000


def test_cluster_runs_the_project_image_and_exposes_serve():
    cluster = MANIFEST["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"].startswith("hybridflow-serve:")
    assert {p["containerPort"] for p in head["ports"]} >= {8000, 6379, 8265}
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["template"]["spec"]["containers"][0]["image"] == head["image"]


def test_schema_rejects_a_broken_manifest():
    schema = json.loads((ROOT / "deploy" / "rayservice.schema.json").read_text())
    broken = json.loads(json.dumps(MANIFEST))
    del broken["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"]
    try:
        jsonschema.validate(broken, schema)
    except jsonschema.ValidationError as exc:
        assert "image" in str(exc.message)
    else:
        raise AssertionError("a container without an image passed")
