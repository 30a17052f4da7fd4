"""Stand-in for Transformers' ``tests/utils/test_configuration_utils.py`` (not in the sdist).

``ConfigTester.check_config_arguments_init`` builds a config from ``config_common_kwargs`` and checks that every
value comes back. This project's own choice of general ``PreTrainedConfig`` arguments, each set to a non-default
value (``dtype`` is compared with ``torch.float16`` by the tester).
"""

config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "output_attentions": True,
    "dtype": "float16",
    "tie_word_embeddings": False,
    "chunk_size_feed_forward": 5,
    "architectures": ["BertModel"],
    "finetuning_task": "translation",
    "id2label": {0: "label"},
    "label2id": {"label": "0"},
    "problem_type": "regression",
}
