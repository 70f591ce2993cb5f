"""Streaming mode, in one place: `planner` (iterable sources, a local buffer per rank, one small
exchange per step: `StreamingPlanner` and its chunk feed) and `mode` (`StreamingMode`, its stateful
iterator)."""

from .mode import StreamingMode, default_collective
from .planner import Chunk, ChunkFeed, ChunkProducer, StreamBuffer, StreamConfig, StreamingPlanner

__all__ = ["Chunk", "ChunkFeed", "ChunkProducer", "StreamBuffer", "StreamConfig", "StreamingMode", "StreamingPlanner",
           "default_collective"]
