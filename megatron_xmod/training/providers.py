"""What megatron's ``pretrain`` builds through us: the config from its parsed arguments, the model
chunks, and the GPT datasets (megatron's own builder)."""
from __future__ import annotations

import dataclasses


def config_from_args(args):
    """XModConfig from megatron's parsed arguments (``--xmod-*`` dests are its field names); a
    MoEConfig when ``--num-experts``/``--moe-preset`` ask for experts."""
    from megatron.training.arguments import core_transformer_config_from_args

    from megatron_xmod.xmod.config import XModConfig

    config = core_transformer_config_from_args(args, XModConfig)
    if config.num_moe_experts is None and getattr(args, "moe_preset", None) is None:
        return config
    from megatron_xmod.moe.args import apply_moe_arguments
    from megatron_xmod.moe.config import MoEConfig

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(XModConfig) if f.init}
    return MoEConfig(**apply_moe_arguments(args, fields))


def build_model(args, pre_process=True, post_process=True, vp_stage=None, pg_collection=None):
    """One model chunk of the model ``args`` describe (dense, MoD, X-MoD, MoE or DTop-p)."""
    from megatron_xmod.model import build_gpt_model

    config = config_from_args(args)
    build = build_gpt_model
    if config.num_moe_experts is not None:
        from megatron_xmod.moe.model import build_moe_gpt_model as build
    model = build(
        config, args.padded_vocab_size, args.max_position_embeddings, pre_process=pre_process,
        post_process=post_process, rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection,
        use_transformer_engine=args.transformer_impl == "transformer_engine",
    )
    from megatron_xmod.pipeline.carry import attach_boundary_carry, carry_channels

    if carry_channels(config):  # the token-choice bias crosses pipeline stages (PP > 1)
        from megatron_xmod.training.patches import widen_pipeline_messages

        widen_pipeline_messages()
    return attach_boundary_carry(model)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)  # paths checked before training
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        # packed sequences: each sample's document boundaries (cu_seqlens), training/step.py packs the micro-batch
        inter_document_masking=getattr(args, "dataloader_inter_document_masking", False),
    )
    # --mock-data: megatron's synthetic MockGPTDataset (no blend), as Megatron-LM's pretrain_gpt.py does.
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0("> building train, validation, and test datasets for GPT ...")
    datasets = BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


# Every rank reads its own copy of the batch (TP ranks see identical samples), so no broadcast.
train_valid_test_datasets_provider.is_distributed = True
