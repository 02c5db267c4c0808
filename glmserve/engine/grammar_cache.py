"""Compiled grammars of a model's tokenizer, cached per GrammarSpec key (xgrammar).

Compiling a JSON schema or a tool-call structural tag costs milliseconds to a second; requests with the
same schema (an agent's every turn) reuse it. Tool calls use xgrammar's GLM structural tag: the GLM
tags (`<tool_call>`, `<arg_key>`, ...) are special tokens, matched as tokens, and each call's
arguments follow its function's JSON schema.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import xgrammar as xgr

from glmserve.core.grammar_spec import GrammarSpec
from glmserve.text.tokenizer import Tokenizer

GLM_STRUCTURAL_TAG = "glm_4_7"  # xgrammar's GLM-4.7 / GLM-5 tool-call format, the one GLM-5.2 keeps


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of a byte-level BPE vocabulary (the raw token strings, ids in order)."""
    size = vocab_size or tokenizer.vocab_size
    vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=size,
                             stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=False)


class GrammarCache:
    """Compiles GrammarSpecs for one tokenizer; keeps the `capacity` most recently used."""

    def __init__(self, info: xgr.TokenizerInfo, capacity: int = 256, threads: int = 1):
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.info = info
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._capacity = capacity
        self.hits = 0
        self.misses = 0

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        key = spec.key
        if key in self._compiled:
            self.hits += 1
            self._compiled.move_to_end(key)
            return self._compiled[key]
        self.misses += 1
        compiled = self._compile(spec)
        self._compiled[key] = compiled
        if len(self._compiled) > self._capacity:
            self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Raises ValueError (naming the field) for a schema xgrammar cannot compile."""
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if spec.kind == "json_schema":
                # json.dumps spacing, as the model saw JSON in training; no runs of free whitespace
                return self._compiler.compile_json_schema(
                    spec.schema, any_whitespace=False, separators=(", ", ": "), strict_mode=True
                )
            return self._compiler.compile_structural_tag(self._tool_tag(spec))
        except (RuntimeError, ValueError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as e:
            field = "response_format.json_schema.schema" if spec.kind == "json_schema" else "tools"
            raise ValueError(f"{field}: cannot be compiled to a grammar: {e}") from e

    @staticmethod
    def _tool_tag(spec: GrammarSpec) -> xgr.StructuralTag:
        tools = json.loads(spec.tools)
        choice = spec.tool_choice
        named = choice not in ("required", "auto")
        return xgr.get_model_structural_tag(
            GLM_STRUCTURAL_TAG,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": choice}} if named else choice,
            reasoning="auto" if spec.after_reasoning else "disabled",
            parallel_tool_calls=spec.parallel_tool_calls,
            max_whitespace_cnt=1,  # values are raw text in GLM's format: whitespace around them would be content
        )
