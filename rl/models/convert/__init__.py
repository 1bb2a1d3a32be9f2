"""DeepSeek-V4's published checkpoint -> what each group loads (`python -m launch.convert`).

`source`: reading and validating the published layout (headers only) and dequantising it;
`writer`: the resumable, checksummed shard-by-shard conversion into an output directory.
"""
from rl.models.convert.source import ConvertError, Source, open_source
from rl.models.convert.writer import ROLLOUT_EXPERTS, TARGETS, convert

__all__ = ["ConvertError", "ROLLOUT_EXPERTS", "Source", "TARGETS", "convert", "open_source"]
