"""Pure logic of fast probes: grid order, fingerprints, the store's repair of a cut-off line."""

import json
import os

from nandoctor.cells import REFERENCE_CELL, Cell
from nandoctor.config import Recipe
from nandoctor.plan import plan_grid
from nandoctor.record import ProbeRecord
from nandoctor.run.fingerprint import environment_key, probe_fingerprint
from nandoctor.run.store import ResultsStore

CPU = {"device": "cpu", "cxx": "/usr/bin/g++", "cpu_count": 2}
CUDA = {
    "device": "cuda",
    "gpus": [{"name": "H100", "capability": "9.0", "memory_bytes": 8e10}],
    "cudnn": 90100,
    "flash_attn": None,
}
ENV = {
    "python": "3.11.7",
    "torch": "2.13.0",
    "transformers": "5.23.0",
    "peft": "0.21.0",
    "cuda": None,
    "cudnn": None,
    "device": "cpu",
    "gpus": [],
    "cpu_model": "Some CPU",
    "ram_available_bytes": 123,
}
SPEC = {
    "probe_id": "fp32/sdpa/off",
    "recipe": {"name": "tiny-llama", "optimizer": {"lr": 1e-3}},
    "cell": {"dtype": "fp32", "attn": "sdpa", "compile": "off"},
    "model_plan": {"source": "architecture-twin", "path": None, "why": "27 GiB free"},
    "steps": 24,
    "seed": 0,
    "device": "cpu",
    "threads": 2,
}


def test_grid_runs_reference_first_then_full_precision_then_half_then_compiled_on_cpu():
    ids = [
        p.probe_id
        for p in plan_grid(
            Recipe(), CPU, {"dtype": ["bf16-amp", "fp32"], "attn": ["sdpa"], "compile": ["inductor", "off"]}
        )
    ]
    assert ids == [
        REFERENCE_CELL.id,
        "fp32/sdpa/off",
        "bf16-amp/sdpa/off",
        "fp32/sdpa/inductor",
        "bf16-amp/sdpa/inductor",
    ]


def test_on_cuda_half_precision_is_not_deferred():
    ids = [
        p.probe_id
        for p in plan_grid(Recipe(), CUDA, {"dtype": ["bf16-amp", "fp32"], "attn": ["sdpa"], "compile": ["off"]})
    ]
    assert ids == [REFERENCE_CELL.id, "bf16-amp/sdpa/off", "fp32/sdpa/off"]


def test_fingerprint_ignores_key_order_probe_id_prose_and_free_memory():
    reordered = dict(reversed(list(SPEC.items())))
    other = {**reordered, "probe_id": "renamed", "model_plan": {**SPEC["model_plan"], "why": "3 GiB free"}}
    assert probe_fingerprint(SPEC, {}, ENV) == probe_fingerprint(other, {}, {**ENV, "ram_available_bytes": 7})


def test_fingerprint_changes_with_anything_that_changes_the_numbers():
    base = probe_fingerprint(SPEC, {}, ENV)
    changed = [
        probe_fingerprint({**SPEC, "steps": 25}, {}, ENV),
        probe_fingerprint({**SPEC, "seed": 1}, {}, ENV),
        probe_fingerprint({**SPEC, "threads": 1}, {}, ENV),
        probe_fingerprint({**SPEC, "recipe": {"name": "tiny-llama", "optimizer": {"lr": 2e-3}}}, {}, ENV),
        probe_fingerprint(SPEC, {"optimizer.eps": 1e-4}, ENV),
        probe_fingerprint(SPEC, {}, {**ENV, "torch": "2.14.0"}),
        probe_fingerprint(SPEC, {}, {**ENV, "cpu_model": "Another CPU"}),
    ]
    assert base not in changed and len(set(changed)) == len(changed)


def test_environment_key_names_gpus_by_model_not_memory():
    gpu = {"name": "H100", "capability": "9.0", "memory_bytes": 1, "index": 0}
    assert environment_key({**ENV, "gpus": [gpu]}) == environment_key({**ENV, "gpus": [{**gpu, "memory_bytes": 2}]})


def test_store_drops_a_half_written_last_line_before_appending(tmp_path):
    store = ResultsStore(tmp_path)
    store.append(ProbeRecord("a", Cell()))
    with open(store.results_path, "a") as f:
        f.write('{"probe_id": "b", "ste')
    store.drop_partial_line()
    store.append(ProbeRecord("c", Cell()))
    assert [r.probe_id for r in store.records()] == ["a", "c"]


def test_recipe_round_trips_through_run_json_for_resume():
    from nandoctor.config import recipe_from_dict, recipe_to_dict
    from nandoctor.recipes import resolve_model

    recipe = resolve_model(None)
    data = json.loads(json.dumps(recipe_to_dict(recipe)))  # as run.json holds it: tuples became lists
    assert recipe_from_dict({k: v for k, v in data.items() if k != "name"}, data["name"]) == recipe


def data_spec(**data) -> dict:
    return {**SPEC, "recipe": {**SPEC["recipe"], "data": {"source": "file", **data}}}


def test_editing_the_data_file_in_place_invalidates_its_cache_entry(tmp_path):
    from nandoctor.run.cache import ProbeCache

    rows = tmp_path / "rows.txt"
    rows.write_text("the first version of the data\n")
    before = probe_fingerprint(data_spec(path=str(rows)), {}, ENV)
    stat = rows.stat()
    rows.write_text("the other version of the data\n")  # same size
    os.utime(rows, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the same time, as a copy that keeps it
    assert rows.stat().st_size == stat.st_size
    after = probe_fingerprint(data_spec(path=str(rows)), {}, ENV)
    assert after != before
    cache = ProbeCache(tmp_path / "cache")
    cache.add(ProbeRecord("fp32/sdpa/off", Cell(), "ok", fingerprint=before), tmp_path / "run")
    assert cache.lookup(before) is not None and cache.lookup(after) is None


def test_a_data_directory_is_fingerprinted_by_its_files_names_and_contents(tmp_path):
    tok = tmp_path / "tok"
    (tok / "sub").mkdir(parents=True)
    (tok / "tokenizer.json").write_text('{"model": "a"}')
    (tok / "sub" / "extra.txt").write_text("x")

    def fingerprint():
        return probe_fingerprint(data_spec(path=None, tokenizer=str(tok)), {}, ENV)

    first = fingerprint()
    assert fingerprint() == first
    (tok / "tokenizer.json").write_text('{"model": "b"}')
    edited = fingerprint()
    (tok / "sub" / "extra.txt").rename(tok / "sub" / "renamed.txt")
    assert len({first, edited, fingerprint()}) == 3


def test_another_nandoctor_version_invalidates_every_cache_entry(monkeypatch):
    import nandoctor

    before = probe_fingerprint(SPEC, {}, ENV)
    monkeypatch.setattr(nandoctor, "__version__", "99.0.0")
    assert probe_fingerprint(SPEC, {}, ENV) != before


def recipe_with(key=None, value=None) -> dict:
    from nandoctor.config import recipe_to_dict, set_field

    return recipe_to_dict(set_field(Recipe(), key, value) if key else Recipe())


def test_the_new_training_fields_change_the_fingerprint():
    base = probe_fingerprint({**SPEC, "recipe": recipe_with()}, {}, ENV)
    for key, value in [
        ("gradient_accumulation_steps", "2"),
        ("loss_normalization", "micro_batch"),
        ("gradient_checkpointing", "reentrant"),
        ("adapter.modules_to_save", "[lm_head]"),
        ("adapter.autocast_adapter_dtype", "false"),
    ]:
        assert probe_fingerprint({**SPEC, "recipe": recipe_with(key, value)}, {}, ENV) != base, key
