"""The user's rows as a probe's stream: every format and kind of row read through `datasets`, tokenized
with a real tokenizer and chat template, labelled, padded or packed, and the batches chosen from a scan
(the first ones, then the worst), each knowing its rows. The synthetic stream stays what it was."""

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import save_llama
from conftest import run_main
from userdata_fixtures import (
    CHAT_TEMPLATE,
    GENERATION_TEMPLATE,
    chat_rows,
    prompt_completion_rows,
    save_chat_tokenizer,
    text_rows,
    write_jsonl,
    write_rows,
)

from nandoctor.config import Recipe, recipe_from_dict
from nandoctor.data import batches, stream
from nandoctor.errors import NandoctorError
from nandoctor.models import model_config
from nandoctor.recipes import resolve_model
from nandoctor.userdata.rows import encoded_rows
from nandoctor.userdata.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return save_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


@pytest.fixture(scope="module")
def config():
    return model_config(resolve_model(None))  # tiny-llama: vocab 4096, no tokenizer of its own


def recipe(path, tokenizer=None, batch_size=4, **data) -> Recipe:
    data = {"path": str(path), **({"tokenizer": str(tokenizer)} if tokenizer else {}), **data}
    return recipe_from_dict({"data": data, "batch_size": batch_size, "seq_len": 64}, "r")


def supervised_text(tokenizer, batch, row: int) -> str:
    ids, labels = batch.inputs["input_ids"][row], batch.inputs["labels"][row]
    return tokenizer.decode(ids[labels != -100].tolist())


def test_the_default_synthetic_stream_is_the_one_before_user_data():
    """Hashes of the first five batches, computed with the stream of e3579fe (before the user's rows):
    fingerprints, caches and every verdict test depend on these exact tensors."""
    r = resolve_model(None)
    cfg = model_config(r)
    got = []
    for fraction, policy, mask in ((0.0, "dedicated", True), (0.5, "id0", True), (0.3, "eos", False)):
        data, pad = dataclasses.replace(r.data, pad_fraction=fraction), dataclasses.replace(r.pad_token, policy=policy)
        s = batches(dataclasses.replace(r, data=data, pad_token=dataclasses.replace(pad, mask_labels=mask)), cfg, 3)
        h = hashlib.sha256()
        for _ in range(5):
            b = next(s)
            for k in ("input_ids", "attention_mask", "labels"):
                h.update(k.encode())
                h.update(b[k].numpy().tobytes())
        got.append(h.hexdigest()[:16])
    assert got == ["46fd38c78169c4c3", "c465d0e79e60a00b", "8d74400cd08ce7ec"]


def test_a_packed_probe_never_reuses_an_unpacked_ones_result():
    from nandoctor.cells import Cell
    from nandoctor.record import ModelPlan, ProbeSpec
    from nandoctor.run.fingerprint import probe_fingerprint

    plan, cell = ModelPlan("architecture-twin", "full", "llama", 1, 1, 1, None, "", {}), Cell("fp32")

    def fingerprint(recipe):
        return probe_fingerprint(ProbeSpec(cell.id, recipe, cell, plan, 2, 0, "cpu", 1).to_dict(), {}, {})

    packed = Recipe(data=dataclasses.replace(Recipe().data, packing="position_ids"))
    assert fingerprint(packed) != fingerprint(Recipe())


def test_a_path_makes_the_source_file_and_the_options_are_validated():
    assert recipe("rows.jsonl").data.source == "file" and Recipe().data.source == "synthetic"
    for key, value in (("packing", "flash"), ("labels", "everything"), ("truncation_side", "middle")):
        with pytest.raises(NandoctorError, match=f"data.{key}={value!r} is not valid; valid:"):
            recipe("rows.jsonl", **{key: value})
    with pytest.raises(NandoctorError, match="pad_fraction shapes the synthetic stream only"):
        recipe("rows.jsonl", pad_fraction=0.5)
    with pytest.raises(NandoctorError, match="completion_only needs rows with a completion"):
        recipe_from_dict({"data": {"labels": "completion_only"}}, "r")


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "rows.csv", "rows.txt", "saved"])
def test_every_format_gives_the_same_batches(tmp_path, tok, config, name):
    rows = text_rows(10, seed=1)
    reference = stream(recipe(write_rows(tmp_path / "ref.jsonl", rows), tok), config, 0)
    got = stream(recipe(write_rows(tmp_path / name, rows), tok), config, 0)
    assert got.source["kind"] == "text" and got.source["rows"] == 10
    for a, b in zip(got.batches, reference.batches, strict=True):
        assert a.rows == b.rows and all((a.inputs[k] == b.inputs[k]).all() for k in a.inputs)


def test_messages_are_rendered_with_the_chat_template_and_completion_only_trains_the_assistant(tmp_path, tok, config):
    rows = chat_rows(8)
    s = stream(recipe(write_jsonl(tmp_path / "chat.jsonl", rows), tok, labels="completion_only"), config, 0)
    tokenizer, first = load_tokenizer(tok), s.batches[0]
    ids = first.inputs["input_ids"][0][first.inputs["attention_mask"][0] == 1].tolist()
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False)
    for i in range(4):
        assert supervised_text(tokenizer, first, i) == rows[i]["messages"][1]["content"] + "</s>"


def test_a_generation_marked_template_labels_multi_turn_chats_in_one_render_as_prefix_rendering_does(tmp_path, config):
    # issue 34: each assistant turn rendered its whole prefix again (twice the tokenizing TRL pays with
    # return_assistant_tokens_mask); a template with {% generation %} marks now says them in one render
    import transformers

    rows = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12, seed=3, turns=3))
    plain = save_chat_tokenizer(tmp_path / "plain")
    marked = save_chat_tokenizer(tmp_path / "marked", template=GENERATION_TEMPLATE)
    calls = []
    render = transformers.PreTrainedTokenizerBase.apply_chat_template

    def counted(self, conversation, *args, **kwargs):
        calls.append(kwargs.get("return_assistant_tokens_mask", False))
        return render(self, conversation, *args, **kwargs)

    transformers.PreTrainedTokenizerBase.apply_chat_template = counted
    try:
        by_prefix = stream(recipe(rows, plain, labels="completion_only", max_length=512), config, 0)
        prefix_calls, calls[:] = len(calls), []
        by_marks = stream(recipe(rows, marked, labels="completion_only", max_length=512), config, 0)
    finally:
        transformers.PreTrainedTokenizerBase.apply_chat_template = render
    assert calls == [True] and prefix_calls > 12  # one batched render, where prefixes took one per turn
    for a, b in zip(by_marks.batches, by_prefix.batches, strict=True):
        assert all((a.inputs[k] == b.inputs[k]).all() for k in a.inputs)
    tokenizer = load_tokenizer(marked)
    chat = chat_rows(12, seed=3, turns=3)[0]["messages"]
    said = supervised_text(tokenizer, by_marks.batches[0], 0)
    assert said == "".join(m["content"] + "</s>" for m in chat if m["role"] == "assistant")


def test_whole_chats_are_trained_under_attention_mask_labels(tmp_path, tok, config):
    rows = chat_rows(4)
    s = stream(recipe(write_jsonl(tmp_path / "chat.jsonl", rows), tok, labels="attention_mask"), config, 0)
    first = s.batches[0].inputs
    assert ((first["labels"] == -100) == (first["attention_mask"] == 0)).all()


@pytest.mark.parametrize("conversational", [False, True])
def test_prompt_completion_trains_the_completion_and_its_eos(tmp_path, tok, config, conversational):
    rows = prompt_completion_rows(4)
    if conversational:
        rows = [
            {
                "prompt": [{"role": "user", "content": r["prompt"]}],
                "completion": [{"role": "assistant", "content": r["completion"]}],
            }
            for r in rows
        ]
    s = stream(recipe(write_jsonl(tmp_path / "pc.jsonl", rows), tok, labels="completion_only"), config, 0)
    tokenizer = load_tokenizer(tok)
    for i, row in enumerate(rows):
        completion = row["completion"][0]["content"] if conversational else row["completion"]
        assert supervised_text(tokenizer, s.batches[0], i).strip() == completion.strip() + "</s>"


def test_pre_tokenized_rows_keep_their_labels_mask_and_positions_without_a_tokenizer(tmp_path, config):
    rows = [
        {
            "input_ids": [5, 6, 7, 8],
            "labels": [-100, -100, 7, 8],
            "attention_mask": [1, 1, 1, 1],
            "position_ids": [0, 1, 0, 1],
        },
        {"input_ids": [9, 10, 11], "labels": [9, 10, 11], "attention_mask": [1, 1, 0], "position_ids": [0, 1, 2]},
    ]
    s = stream(recipe(write_jsonl(tmp_path / "ids.jsonl", rows), batch_size=2), config, 0)
    b = s.batches[0].inputs
    assert s.source["kind"] == "tokens" and s.source["tokenizer"] is None
    assert b["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 4095]]  # padded with the dedicated pad id
    assert b["labels"].tolist() == [[-100, -100, 7, 8], [9, 10, 11, -100]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 0]]


def test_a_model_without_a_local_tokenizer_reads_only_pre_tokenized_rows(tmp_path, config):
    r = recipe(write_jsonl(tmp_path / "chat.jsonl", chat_rows(2)))
    with pytest.raises(NandoctorError) as e:
        stream(r, config, 0)
    assert "no local tokenizer: pass --tokenizer DIR" in str(e.value) and "pre-tokenized input_ids" in str(e.value)
    assert "\n" not in str(e.value)


def test_the_checkpoints_own_tokenizer_is_used_when_none_is_named(tmp_path):
    ckpt = save_llama(tmp_path / "ckpt")
    save_chat_tokenizer(ckpt)
    r = dataclasses.replace(resolve_model(str(ckpt)), data=recipe(write_jsonl(tmp_path / "t.jsonl", text_rows(4))).data)
    assert stream(r, model_config(r), 0).source["tokenizer"] == str(ckpt)


def test_truncation_keeps_the_side_asked_for_and_left_padding_pads_before(tmp_path, tok, config):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows(4, words=(30, 40)))
    right = stream(recipe(path, tok, max_length=8), config, 0).batches[0].inputs["input_ids"]
    left = stream(recipe(path, tok, max_length=8, truncation_side="left"), config, 0).batches[0].inputs["input_ids"]
    full = stream(recipe(path, tok, max_length=512), config, 0).batches[0].inputs
    row = full["input_ids"][0][full["attention_mask"][0] == 1]
    assert right[0].tolist() == row[:8].tolist() and left[0].tolist() == row[-8:].tolist()
    short = write_jsonl(tmp_path / "s.jsonl", [{"text": "the cat"}, {"text": "the cat sat on the mat and the dog ran"}])
    padded = stream(recipe(short, tok, batch_size=2, padding_side="left"), config, 0).batches[0].inputs
    assert padded["attention_mask"][0].tolist()[0] == 0 and padded["attention_mask"][0].tolist()[-1] == 1


@pytest.mark.parametrize("template", [True, False])
def test_alpaca_rows_are_a_prompt_and_the_output_its_completion(tmp_path, template):
    tok = save_chat_tokenizer(tmp_path / "tok", template=CHAT_TEMPLATE if template else None)
    rows = [
        {"instruction": "add two and two", "input": "two two", "output": " four"},
        {"instruction": "why does water boil", "input": "", "output": " because heat"},
    ] * 2
    r = recipe(write_jsonl(tmp_path / "alpaca.jsonl", rows), tok, labels="completion_only")
    s = stream(r, model_config(resolve_model(None)), 0)
    tokenizer, first = load_tokenizer(tok), s.batches[0]
    assert s.source["kind"] == "alpaca"
    for i, row in enumerate(rows):
        ids = first.inputs["input_ids"][i][first.inputs["attention_mask"][i] == 1].tolist()
        prompt = row["instruction"] + (f"\n\n{row['input']}" if row["input"] else "")
        if template:
            chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": row["output"]}]
            assert tokenizer.decode(ids) == tokenizer.apply_chat_template(chat, tokenize=False)
        else:
            assert tokenizer.decode(ids) == prompt + "\n\n" + row["output"] + "</s>"
        assert supervised_text(tokenizer, first, i) == row["output"] + "</s>"


@pytest.mark.parametrize("packing", ["position_ids", "block_mask"])
def test_an_empty_row_adds_nothing_to_a_packed_batch(tmp_path, tok, config, packing):
    rows = text_rows(4)
    rows[1] = {"text": ""}
    packed = stream(recipe(write_jsonl(tmp_path / "t.jsonl", rows), tok, packing=packing), config, 0).batches[0]
    assert packed.inputs["labels"].shape == packed.inputs["input_ids"].shape == packed.inputs["position_ids"].shape
    assert (packed.inputs["position_ids"][0] == 0).sum() == 3  # three segments: the empty row is none


@pytest.mark.parametrize("packing", ["position_ids", "block_mask"])
def test_packing_flattens_the_batch_with_positions_restarting_per_row(tmp_path, tok, config, packing):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows(4))
    padded = stream(recipe(path, tok), config, 0).batches[0].inputs
    packed = stream(recipe(path, tok, packing=packing), config, 0).batches[0].inputs
    lengths = padded["attention_mask"].sum(dim=1).tolist()
    assert packed["input_ids"].tolist() == [
        [t for row, n in zip(padded["input_ids"], lengths) for t in row[:n].tolist()]
    ]
    assert packed["position_ids"].tolist() == [[p for n in lengths for p in range(n)]]
    starts = [sum(lengths[:i]) for i in range(4)]
    assert all(packed["labels"][0, s] == -100 for s in starts)  # never predicted across a boundary
    if packing == "position_ids":
        assert "attention_mask" not in packed
    else:
        mask = packed["attention_mask"]
        assert mask.shape == (1, 1, sum(lengths), sum(lengths)) and mask.dtype.is_floating_point
        assert mask[0, 0, starts[1], starts[1] - 1] < -1e30 and mask[0, 0, starts[1], starts[1]] == 0


def test_the_first_batches_in_order_then_the_worst_each_with_its_rows(tmp_path, tok, config):
    rows = text_rows(20, seed=2, words=(5, 10))
    rows[13] = {"text": " ".join(["the"] * 60)}  # the longest row
    rows[7] = {"text": "cat"}  # the shortest
    s = stream(recipe(write_jsonl(tmp_path / "t.jsonl", rows), tok, batches=2), config, seed=5)
    kinds = [b.kind for b in s.batches]
    assert kinds[:2] == ["first", "first"] and s.batches[0].rows == (0, 1, 2, 3) and s.batches[1].rows == (4, 5, 6, 7)
    by_kind = {b.kind: b for b in s.batches}
    assert 13 in by_kind["longest"].rows and by_kind["most_padded"].rows[0] == 13 and 7 in by_kind["most_padded"].rows
    assert by_kind["most_padded"].padded == max(b.padded for b in s.batches)
    assert [b.rows for b in stream(recipe(tmp_path / "t.jsonl", tok, batches=2), config, seed=5).batches] == [
        b.rows for b in s.batches
    ]
    described = s.describe()["batches"]
    assert described[0] == {
        "kind": "first",
        "rows": [0, 1, 2, 3],
        **{k: getattr(s.batches[0], k) for k in ("tokens", "padded", "supervised")},
    }


def test_steps_group_micro_batches_with_their_token_count(tmp_path, tok, config):
    s = stream(recipe(write_jsonl(tmp_path / "t.jsonl", text_rows(16)), tok, batches=4), config, 0)
    group, items = next(s.steps(2))
    assert [b.rows for b in group] == [s.batches[0].rows, s.batches[1].rows]
    assert items == sum(int((b.inputs["labels"][:, 1:] != -100).sum()) for b in group)


def test_the_encoded_rows_are_read_back_from_the_datasets_cache(tmp_path, tok, config):
    """A second stream over the same rows, options and tokenizer (another probe, another process) maps
    the Arrow file the first one wrote instead of tokenizing again."""
    r = recipe(write_jsonl(tmp_path / "t.jsonl", text_rows(8)), tok)
    first = encoded_rows(r, config).rows.cache_files[0]["filename"]
    written = Path(first).stat().st_mtime_ns
    code = (
        "import sys, json; from nandoctor.config import recipe_from_dict; from nandoctor.userdata.rows import "
        "encoded_rows; r = recipe_from_dict(json.loads(sys.argv[1]), 'r'); "
        "print(encoded_rows(r, None).rows.cache_files[0]['filename'])"
    )
    given = json.dumps({"data": {"path": r.data.path, "tokenizer": r.data.tokenizer}, "batch_size": 4, "seq_len": 64})
    again = subprocess.run([sys.executable, "-c", code, given], capture_output=True, text=True, check=True).stdout
    again = again.strip().splitlines()[-1]
    assert again == first and Path(first).stat().st_mtime_ns == written
    other = encoded_rows(dataclasses.replace(r, data=dataclasses.replace(r.data, max_length=8)), config)
    assert other.rows.cache_files[0]["filename"] != first


def test_a_change_to_the_encoding_code_is_not_served_from_the_cache(tmp_path, tok, config, monkeypatch):
    """datasets hashes a module's functions by name: a cache keyed by them served rows encoded by the old
    code (and its old columns) after encode.py changed. The file's own text keys the cache."""
    import nandoctor.userdata.encode as encode

    r = recipe(write_jsonl(tmp_path / "t.jsonl", text_rows(8)), tok)
    before = encoded_rows(r, config).rows.cache_files[0]["filename"]
    edited = tmp_path / "encode.py"
    edited.write_text(Path(encode.__file__).read_text() + "\n# an edit\n")
    monkeypatch.setattr(encode, "__file__", str(edited))
    assert encoded_rows(r, config).rows.cache_files[0]["filename"] != before


@pytest.mark.parametrize(
    "name, content, says",
    [
        ("missing.jsonl", None, "does not exist"),
        ("rows.xml", "<rows/>", "cannot tell its format from its name; valid: a .jsonl"),
        ("rows.jsonl", json.dumps({"question": "?"}) + "\n", "has columns question; nandoctor reads one of"),
        ("rows.jsonl", "{not json\n", "cannot read data"),
    ],
)
def test_bad_data_is_one_line_and_exit_2(tmp_path, name, content, says):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    proc = run_main("doctor", "--data", path, "--axis", "dtype=fp32", "--axis", "attn=sdpa")
    assert proc.returncode == 2 and says in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _lines(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


CHAT = {"messages": [{"role": "user", "content": "two plus two"}, {"role": "assistant", "content": "four"}]}
# ordinary data that used to end in a traceback (or in datasets' "An error occurred while generating the
# dataset"): one line naming the file, the row or line, and the cause
BAD_ROWS = {
    "row-without-messages": (_lines(CHAT, CHAT, {"messages": None}), "row 2 (counting from 0): `messages` is missing"),
    "text-null": (_lines({"text": "the cat"}, {"text": None}), "row 1 (counting from 0): `text` is missing (null)"),
    "messages-a-string": (_lines({"messages": "hello"}), "row 0 (counting from 0): `messages` is a str, 'hello'"),
    "messages-of-strings": (_lines({"messages": ["hello"]}), "row 0 (counting from 0): `messages` is a list holding"),
    "empty-file": (b"", "is an empty file: it has no rows"),
    "latin-1": (b'{"text": "the caf\xe9 sat"}\n', "line 1 is not UTF-8 text (byte 0xe9 at column 18)"),
    "malformed-line": (_lines(CHAT, CHAT, b'{"messages": [', CHAT), "line 3 is not JSON (Expecting value, column 15)"),
    "binary": (bytes(range(255, -1, -1)) * 4, "line 1 is not UTF-8 text (byte 0xff at column 1)"),
    "a-json-list-per-line": (_lines(CHAT, [1, 2]), "line 2 is a JSON list, not an object"),
}


def bad_rows(tmp_path, tok, command: str, case: str):
    content, says = BAD_ROWS[case]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    out = tmp_path / "run"
    args = ("--data", path, "--tokenizer", tok, "--axis", "dtype=fp32", "--axis", "attn=sdpa")
    proc = run_main(command, *args, *(("--out", out) if command == "grid" else ()))
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("nandoctor: error: "), proc.stderr
    assert repr(str(path)) in proc.stderr and says in proc.stderr, proc.stderr
    assert not out.exists()  # nothing half-written


@pytest.mark.parametrize("case", BAD_ROWS)
def test_ordinary_bad_rows_are_one_line_naming_the_row_and_exit_2(tmp_path, tok, case):
    bad_rows(tmp_path, tok, "doctor", case)


@pytest.mark.parametrize("case", ["row-without-messages", "malformed-line", "latin-1"])
def test_a_grid_on_bad_rows_stops_before_it_starts_a_worker_with_the_same_line(tmp_path, tok, case, monkeypatch):
    import nandoctor.api

    def no_session(*args, **kwargs):
        raise AssertionError("a session (and its first warm worker) was started before the rows were read")

    monkeypatch.setattr(nandoctor.api, "Session", no_session)
    bad_rows(tmp_path, tok, "grid", case)


def test_non_utf8_plain_text_names_its_line(tmp_path, tok):
    path = tmp_path / "rows.txt"
    path.write_bytes(b"the cat sat\nthe caf\xe9 sat\n")
    proc = run_main("doctor", "--data", path, "--tokenizer", tok)
    assert proc.returncode == 2 and "line 2 is not UTF-8 text (byte 0xe9 at column 8)" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
