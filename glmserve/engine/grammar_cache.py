"""Compiled grammars of a model's tokenizer, cached per GrammarSpec key (xgrammar).

Compiling a JSON schema or a tool-call structural tag costs milliseconds to a second; requests with the
same schema (an agent's every turn) reuse it. Tool calls use xgrammar's GLM structural tag: the GLM
tags (`<tool_call>`, `<arg_key>`, ...) are matched as the special tokens the model emits, and each
call's arguments follow its function's JSON schema. Reasoning is not part of the compiled grammar:
`RequestGrammar` lets the `<think>` part through and starts the grammar after it.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import xgrammar as xgr

from glmserve.core.grammar_spec import GrammarSpec
from glmserve.engine.grammar_tokens import GrammarTokens
from glmserve.text.tokenizer import Tokenizer

GLM_STRUCTURAL_TAG = "glm_4_7"  # xgrammar's GLM-4.7 / GLM-5 tool-call format, the one GLM-5.2 keeps
JSON_SEPARATORS = (", ", ": ")  # json.dumps spacing, as the model saw JSON in training


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of a byte-level BPE vocabulary (the raw token strings, ids in order);
    ``vocab_size``: the width of the model's logits when it pads the vocabulary."""
    size = vocab_size or tokenizer.vocab_size
    vocab = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=size,
                             stop_token_ids=list(tokenizer.eos_token_ids), add_prefix_space=False)


class GrammarCache:
    """Compiles GrammarSpecs for one tokenizer; keeps the `capacity` most recently used."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, capacity: int = 256, threads: int = 1):
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.info = tokenizer_info(tokenizer, self.vocab_size)
        self.tokens = GrammarTokens.from_tokenizer(tokenizer, self.vocab_size)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._capacity = capacity
        self.hits = 0
        self.misses = 0

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; ValueError (naming the field) if it cannot be compiled."""
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
        try:
            if spec.kind == "json_object":
                return self._compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False)
            if spec.kind == "json_schema":
                return self._compiler.compile_json_schema(
                    spec.schema, any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=spec.strict)
            return self._compiler.compile_structural_tag(self._tool_tag(spec))
        except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as e:
            field = "response_format.json_schema.schema" if spec.kind == "json_schema" else "tools"
            raise ValueError(f"{field}: cannot be compiled to a grammar: {e}") from e

    @staticmethod
    def _tool_tag(spec: GrammarSpec) -> xgr.StructuralTag:
        tools = json.loads(spec.tools)
        named = spec.tool_choice != "required"
        return xgr.get_model_structural_tag(
            GLM_STRUCTURAL_TAG,
            tools=tools,
            tool_choice={"type": "function", "function": {"name": spec.tool_choice}} if named else "required",
            reasoning="disabled",
            parallel_tool_calls=spec.parallel_tool_calls,
            # The fewest xgrammar allows: a whitespace around a value is formatting (the parser
            # strips it, as GLM's reference parsers do), a run of them would only waste tokens.
            max_whitespace_cnt=1,
        )
