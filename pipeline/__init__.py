"""Data-node side: shard lists, sample reading, header-only token counting, the reader service.

Public entry points live in their modules (nothing is imported here, so importing one light
module such as `pipeline.records` never loads Pillow or soundfile): `pipeline.shards`
(expand_shards, split_shards), `pipeline.reader` (ReaderConfig, iter_shard, iter_samples),
`pipeline.counting` (CountingConfig), `pipeline.errors` (ErrorPolicy, ErrorStats),
`pipeline.gendata` (generate).
"""
