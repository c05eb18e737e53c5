"""The user's own data, read the way fine-tuning code reads it: a file or a `save_to_disk` directory
through Hugging Face `datasets` (memory-mapped Arrow), tokenized with the user's tokenizer and chat
template, labelled, collated (padded or packed), and the batches a probe trains on chosen from a scan
of every row.

The stages, in the order the data flows through them:
  tokenizer.py  which tokenizer (a local directory; never downloaded) and which pad id (`pad_id`: the
                one pad policy)
  read.py       the file as a `datasets.Dataset`, and what kind of rows it holds
  encode.py     rows to token ids and labels, with per-row figures (length, supervised tokens, ...)
  collate.py    rows to one batch of tensors: padded, or packed by position_ids or a block mask
  select.py     which batches: the first ones in order, then the worst ones the scan finds
  rows.py       the stages above run for a recipe: the encoded rows the stream and the lint share
  lint.py       the data lint's scan of the encoded rows, and the findings of rules.yaml its figures fire

userdata reads and encodes; it builds no model. The checks measured on the model are
nandoctor/measure/ (measure/lint.py for the lint), run by doctor.data_lint.

`nandoctor.data.stream` is the one entry point a probe calls; it serves the synthetic stream too.
"""
