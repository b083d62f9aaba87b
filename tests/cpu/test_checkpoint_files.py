"""Which files of a checkpoint folder hold its weights, chosen as transformers' ``from_pretrained``
(the oracle) chooses them: ``config.json``'s ``transformers_weights``, else ``model.safetensors``,
else the shards ``model.safetensors.index.json`` lists; never any other ``*.safetensors`` file."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from test_engine_hf import build_hf, compare

from graphtune.engine import load_checkpoint
from graphtune.errors import CheckpointError

transformers = pytest.importorskip("transformers")


def _transformers(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager"
    ).eval()


def _two_checkpoints(tmp_path, shard: str | None = None):
    """A folder of seed-0 weights (sharded when ``shard``) and one of other, seed-1, weights."""
    _, folder = build_hf("llama", tmp_path / "a", max_shard_size=shard)
    _, other = build_hf("llama", tmp_path / "b", seed=1)
    return folder, other / "model.safetensors"


def test_model_safetensors_wins_over_an_index(tmp_path):
    folder, other = _two_checkpoints(tmp_path, shard="40KB")
    assert (folder / "model.safetensors.index.json").is_file()
    shutil.copy(other, folder / "model.safetensors")
    compare(_transformers(folder), folder, decode_steps=2)


def test_other_safetensors_files_are_not_read(tmp_path, caplog):
    # A tensor of model_ema.safetensors (later in sorted order) took model.safetensors' place.
    folder, other = _two_checkpoints(tmp_path)
    shutil.copy(other, folder / "model_ema.safetensors")
    with caplog.at_level(logging.INFO, logger="graphtune.engine.safetensors_source"):
        compare(_transformers(folder), folder, decode_steps=2)
    assert "not reading model_ema.safetensors" in caplog.text


def test_a_folder_with_only_other_safetensors_files_is_refused_in_one_line(tmp_path):
    folder, _ = _two_checkpoints(tmp_path)
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    with pytest.raises(OSError, match="no file named model.safetensors"):
        _transformers(folder)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message and "model.safetensors.index.json" in message
    assert "weights.safetensors" in message


def _set_weights(folder, value) -> None:
    doc = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**doc, "transformers_weights": value}))


@pytest.mark.parametrize("sharded", [False, True])
def test_config_transformers_weights_names_the_file(tmp_path, sharded):
    folder, other = _two_checkpoints(tmp_path)
    if sharded:
        _, split = build_hf("llama", tmp_path / "c", seed=1, max_shard_size="40KB")
        for file in split.glob("model*.safetensors*"):
            shutil.copy(file, folder / file.name.replace("model", "alt"))
        index = folder / "alt.safetensors.index.json"
        doc = json.loads(index.read_text())
        doc["weight_map"] = {k: v.replace("model", "alt") for k, v in doc["weight_map"].items()}
        index.write_text(json.dumps(doc))
        _set_weights(folder, index.name)
    else:
        shutil.copy(other, folder / "alt.safetensors")
        _set_weights(folder, "alt.safetensors")
    compare(_transformers(folder), folder, decode_steps=2)


@pytest.mark.parametrize("value", ["../b/llama/model.safetensors", "model.bin", 3])
def test_a_bad_transformers_weights_is_refused_in_one_line(tmp_path, value):
    folder, _ = _two_checkpoints(tmp_path)
    _set_weights(folder, value)
    with pytest.raises((ValueError, AttributeError)):
        _transformers(folder)
    with pytest.raises(CheckpointError, match="transformers_weights=") as info:
        load_checkpoint(folder)
    assert "\n" not in str(info.value)


def test_shard_tensors_are_found_in_the_files_not_the_index(tmp_path):
    # transformers reads every tensor of each listed shard; the map's file names are not used.
    _, folder = build_hf("llama", tmp_path, max_shard_size="40KB")
    index = folder / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    shards = sorted(set(doc["weight_map"].values()))
    doc["weight_map"] = {
        k: shards[0] if v == shards[-1] else v for k, v in doc["weight_map"].items()
    }
    doc["weight_map"]["model.norm.weight"] = shards[-1]
    index.write_text(json.dumps(doc))
    compare(_transformers(folder), folder, decode_steps=2)
