"""Policies: one small file each, registered by name."""

from .base import (AllocatedBudgetPolicy, BudgetPolicy, Codec, Context, DecodeEviction, Policy, ReadView, ScorerPolicy,
                   StorageTier, Merger, Summarizer, select_kept)
from .registry import get_policy_class, list_policies, register, resolve_policy
from .none import NoCompression
from .knorm import Knorm
from .random import RandomPolicy
from .tova import TOVA
from .snapkv import SnapKV
from .h2o import H2O
from .less import LESS
from .keyformer import Keyformer
from .streaming_llm import StreamingLLM
from .freqkv import FreqKV
from .kvzip import KVzip
from .laq import LookaheadQCache
from .expected_attention import ExpectedAttention
from .keydiff import KeyDiff
from .kvzap import KVzap
from .duo_attention import DuoAttention
from .kivi import KIVI
from .gear import GEAR
from .zipcache import ZipCache
from .commvq import CommVQ
from .compose import Composed
from .sparse import Quant4View, Quest, ReadPolicy, Retrieval, SinkWindow, TopK
from .token_select import TokenSelect
from .recycled_attention import RecycledAttention
from .hip import HiP
from .tidal_decode import TidalDecode
from .lserve import LServe
from .double_sparsity import DoubleSparsity
from .shadowkv import ShadowKV, ShadowKVView
from .subgen import SubGen

__all__ = [
    "Policy", "BudgetPolicy", "AllocatedBudgetPolicy", "ScorerPolicy", "Context", "select_kept",
    "Codec", "ReadView", "DecodeEviction", "StorageTier", "Merger", "Summarizer",
    "register", "list_policies", "get_policy_class", "resolve_policy",
    "NoCompression", "Knorm", "RandomPolicy", "TOVA", "SnapKV", "H2O", "LESS", "Keyformer", "StreamingLLM", "FreqKV", "KVzip", "LookaheadQCache", "ExpectedAttention", "KeyDiff", "KVzap", "DuoAttention",
    "KIVI", "GEAR", "ZipCache", "CommVQ", "Composed", "ReadPolicy", "Quest", "Retrieval", "TopK", "SinkWindow", "TokenSelect", "RecycledAttention", "HiP", "TidalDecode", "LServe", "DoubleSparsity", "ShadowKV", "ShadowKVView", "SubGen", "Quant4View",
]
