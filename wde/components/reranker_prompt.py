"""The prompt an LLM reranker reads: a (query, document) pair filled into an instruction template, between a
fixed token prefix and suffix (Qwen3-Reranker's chat turns).

Two components, as the reference builds the prompt in two steps: the input processor formats the body text
`<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}` (cheap string work, at admission), and
the tokenizer puts the prefix and suffix tokens around the body's tokens, so truncation shortens only the body
(from its end by default: the document's tail), never the template's turns.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Literal, Sequence

from pydantic import Field, field_validator

from wde.components.base import BuildContext
from wde.components.input_processor import InputName, TextInputParams, TextInputProcessor
from wde.components.tokenizer import Encoded, HFTokenizer, HFTokenizerParams, PromptOptions
from wde.errors import ModelLoadError
from wde.request import PairPrompt, PoolingParams, Prompt, TextPrompt

TEMPLATE_FIELDS = {"instruction", "query", "document"}


class InstructionPairParams(TextInputParams):
    pairs: Literal["require"] = "require"
    template: str = Field(..., description="body text with the fields {instruction}, {query} and {document}")
    instruction: str = Field(..., description="the instruction when a request names none (prompt / prompt_name)")

    @field_validator("template")
    @classmethod
    def _fields(cls, template: str) -> str:
        try:
            used = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
        except ValueError as e:
            raise ValueError(f"template is not a valid format string: {e}") from None
        if set(used) != TEMPLATE_FIELDS or len(used) != len(TEMPLATE_FIELDS):
            raise ValueError(f"template must use each of {{instruction}}, {{query}} and {{document}} exactly once"
                             f" and no other field; it uses {used}")
        return template


class InstructionPairInput(TextInputProcessor):
    """Fills each (query, document) pair into `template` with the request's instruction.

    The instruction is the request's `prompt` text, else the named `prompt_name` (from `prompts`), else the
    `instruction` param. Token ids (`{"token_ids": [...]}`) are taken as a complete, already formatted input.
    """

    name = "instruction_pair"
    Params = InstructionPairParams

    def __init__(self, params: InstructionPairParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        self.template = params.template
        self.instruction = params.instruction

    def _instruction(self, params: PoolingParams) -> str:
        if params.prompt is None and (params.prompt_name or self.default_prompt_name) is None:
            return self.instruction
        return self._prompt_prefix(params)

    def to_prompt(self, inputs: Any, params: PoolingParams, field: InputName = "input") -> Prompt:
        instruction = self._instruction(params)
        prompt = super().to_prompt(inputs, dataclasses.replace(params, prompt=""), field)
        if isinstance(prompt, PairPrompt):
            return TextPrompt(self.template.format(instruction=instruction, query=prompt.text,
                                                   document=prompt.text_pair))
        return prompt


class AffixTokenizerParams(HFTokenizerParams):
    prefix: str = Field("", description="text whose tokens (no special tokens added) precede every input")
    suffix: str = Field("", description="text whose tokens follow every input")


class AffixTokenizer(HFTokenizer):
    """The Hugging Face tokenizer, with fixed prefix and suffix token ids around every input's own tokens.

    The affixes are tokenized once, alone, as the reference does (`prefix_ids + tokenize(body) + suffix_ids`);
    the max length counts them, and truncation cuts only the tokens between them.
    """

    name = "affix_tokenizer"
    Params = AffixTokenizerParams

    def __init__(self, params: AffixTokenizerParams, ctx: BuildContext) -> None:
        super().__init__(params, ctx)
        if params.add_eos and params.suffix:
            raise ModelLoadError("tokenizer.params.add_eos would put the EOS between the input and the suffix;"
                                 " end tokenizer.params.suffix with the EOS token instead")
        self.prefix_ids: list[int] = self._affix(params.prefix)
        self.suffix_ids: list[int] = self._affix(params.suffix)
        self.num_affix_tokens = len(self.prefix_ids) + len(self.suffix_ids)
        if self.max_length <= self.num_affix_tokens:
            raise ModelLoadError(f"the tokenizer's max length {self.max_length} leaves no room for an input between"
                                 f" the {self.num_affix_tokens} prefix and suffix tokens")

    def _affix(self, text: str) -> list[int]:
        return self._tok(text, add_special_tokens=False)["input_ids"] if text else []

    def encode(self, prompts: Sequence[TextPrompt | PairPrompt], max_length: int | None = None,
               direction: Literal["left", "right"] = "right", options: PromptOptions | None = None) -> list[Encoded]:
        if max_length is not None:
            if max_length <= self.num_affix_tokens:
                raise ValueError(f"a limit of {max_length} tokens leaves no room for the input between the"
                                 f" {self.num_affix_tokens} prefix and suffix tokens")
            max_length -= self.num_affix_tokens
        pre, suf = self.prefix_ids, self.suffix_ids
        out: list[Encoded] = []
        for ids, types in super().encode(prompts, max_length, direction, options):
            if types is not None:
                types = [0] * len(pre) + types + types[-1:] * len(suf)
            out.append((pre + ids + suf, types))
        return out

    def min_pair_length(self, prompt: PairPrompt) -> int:
        return super().min_pair_length(prompt) + self.num_affix_tokens
