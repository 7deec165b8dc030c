"""What `LLMEngine` and `AsyncLLM` share: the model's tokenizer and configuration (no weights),
the engine configuration resolved against them, and the input and output processors."""

from __future__ import annotations

import logging

from roseinfer.chat_format import chat_format_for
from roseinfer.common.kv_cache_spec import group_pool_sizes, model_kv_cache_groups
from roseinfer.common.messages import EngineCoreRequest
from roseinfer.config import EngineConfig
from roseinfer.core.kv_pool_plan import plan_engine
from roseinfer.engine.input_processor import InputProcessor, ProcessedRequest
from roseinfer.engine.output_processor import OutputProcessor
from roseinfer.models.loader import ModelSource
from roseinfer.multimodal.media import MediaPolicy
from roseinfer.multimodal.prompt_images import PROMPT_IMAGE_PROCESSORS
from roseinfer.pooling_params import PoolingParams
from roseinfer.reasoning import get_reasoning_parser

logger = logging.getLogger("roseinfer")


class EngineFrontEnd:
    def __init__(self, config: EngineConfig) -> None:
        # The thinking model's markup (None: not a thinking model): the API front ends split
        # responses with it (roseinfer/reasoning), the input processor marks requests with it.
        # Looked up first: an unknown name is refused before the model is read.
        self.reasoning_parser = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        source = ModelSource.resolve(config.model, config.tokenizer)
        self.model_source = source  # where the model is on disk (what the Ollama API's /api/show tells)
        self.model_config = source.model_config()
        plan_engine(config, self.model_config)
        self.config = config
        self.tokenizer = source.tokenizer()
        # gpt-oss's prompts are harmony's, rendered by its library (chat_format.py); its output
        # is read by the format's own reasoning parser unless --reasoning-parser names another.
        self.chat_format = chat_format_for(self.model_config.architecture)
        if self.chat_format is not None and self.reasoning_parser is None:
            self.reasoning_parser = get_reasoning_parser(self.chat_format.reasoning_parser)
        self.model_name = config.served_model_name or source.name
        self.max_model_len: int = config.max_model_len
        # A vision-language model's images -> placeholder runs (multimodal/prompt_images.py).
        vision = self.model_config.vision
        prompt_images = PROMPT_IMAGE_PROCESSORS[vision.family](source.path, self.tokenizer) if vision else None
        self.input_processor = InputProcessor(self.tokenizer, self.model_config, self.max_model_len,
                                              self.reasoning_parser,
                                              PoolingParams(config.pooling, config.pooling_normalize),
                                              prompt_images,
                                              MediaPolicy(tuple(config.allowed_media_domains or ()),
                                                          limit_per_prompt=config.limit_mm_per_prompt),
                                              self.chat_format)
        self.output_processor = OutputProcessor(self.tokenizer)

    def register_request(self, processed: ProcessedRequest) -> list[EngineCoreRequest]:
        """Let the output processor expect the request's outputs; returns what the core runs."""
        self.output_processor.add_request(
            processed.request_id, processed.prompt, processed.prompt_token_ids, processed.params,
            [r.request_id for r in processed.core_requests], processed.arrival_time,
        )
        return processed.core_requests

    def get_tokenizer(self):
        return self.tokenizer

    def log_ready(self, seconds: float) -> None:
        config, model = self.config, self.model_config
        dtype = "q8_0" if config.kv_cache_dtype == "q8_0" else str(config.kv_cache_torch_dtype).removeprefix("torch.")
        # One pool per KV cache group (common/kv_cache_spec.py): all layers, or a model's full and
        # sliding layers; a recurrent group's state slots are logged by the pool plan.
        specs = [spec for spec in model_kv_cache_groups(model) if spec.paged]
        sizes = group_pool_sizes(specs, config.num_kv_blocks, config.num_kv_blocks_sliding, config.max_num_seqs)
        pools = []
        for spec, blocks in zip(specs, sizes, strict=True):
            kv_bytes = blocks * model.kv_block_bytes(config.block_size, config.kv_cache_torch_dtype,
                                                     num_layers=len(spec.layers))
            kind = "" if len(spec.layers) == model.num_layers else (
                f" for {len(spec.layers)} full-attention layers" if spec.window is None
                else f" for {len(spec.layers)} layers with window {spec.window}")
            pools.append(f"{blocks} blocks of {config.block_size} tokens{kind} ({kv_bytes / 1024**3:.2f} GiB, {dtype})")
        logger.info(
            "loaded %s (%s, %d layers) on %s/%s, quantization %s, in %.1fs; KV cache: %s, max_model_len %d",
            self.model_name, model.architecture, model.num_layers, config.torch_device,
            str(config.torch_dtype).removeprefix("torch."), config.quantization, seconds,
            "; ".join(pools), self.max_model_len,
        )
