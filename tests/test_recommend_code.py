"""The code a recommendation prints is rendered in recommend.py from the cell table's data (issue 29,
item 4; STYLE.md rule 20): the rows say what a value is (its fp8 recipe, wrapper, reduce dtype, comm
hook), recommend.py writes the lines, and every row renders what it rendered when the strings lived in
cells.py (tests/fixtures/recommendation-code.json, written by the code at e3579fe), bound to names as
pasted code binds them (`args = `, `model = `) and with the probe's constant lr and explicit precision
flags (tests/test_pasted_code.py runs them). Pure."""

import dataclasses
import json
from pathlib import Path

import pytest

from nandoctor import cells
from nandoctor.cells import Cell
from nandoctor.config import Recipe, set_field
from nandoctor.recommend import recommendation

EXPECTED = json.loads((Path(__file__).parent / "fixtures" / "recommendation-code.json").read_text())


def test_the_cell_table_holds_data_not_the_code_that_renders_a_recommendation():
    for row in (cells.Precision, cells.Parallel):
        assert not [f.name for f in dataclasses.fields(row) if "code" in f.name], row.__name__
    source = Path(cells.__file__).read_text()
    for code in ("convert_to_float8_training", "DistributedDataParallel(model", "fully_shard(", "Accelerator(fsdp"):
        assert code not in source


@pytest.mark.parametrize("cell", list(EXPECTED))
def test_every_row_renders_the_code_it_rendered_from_the_cell_table(cell):
    recipe = set_field(Recipe(world_size=4, batch_size=8), "fp8.amax_history_len", "16")
    assert recommendation(Cell.parse(cell).to_dict(), recipe, recipe, [])["python"] == EXPECTED[cell]


def test_the_check_line_of_a_trainer_args_run_trains_with_the_same_trainer():
    """A grid run with --trainer-args probed the user's trainer: the `nandoctor check` line its report
    prints passes the same file (and --trainer), or the check would train nandoctor's own loop."""
    from nandoctor.recommend import model_flags_of

    command = "nandoctor grid --model tiny-llama --trainer-args ./args.json --trainer sft --steps 4 --set lr=1e-4"
    flags = model_flags_of(command, Recipe())
    assert flags == ["--model", "tiny-llama", "--trainer-args", "./args.json", "--trainer", "sft", "--set", "lr=1e-4"]
    assert model_flags_of("nandoctor grid --model tiny-llama --trainer-args=args.json", Recipe())[2:] == [
        "--trainer-args",
        "args.json",
    ]
