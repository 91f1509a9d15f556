"""Runtime environments shipped inside the wheel as ``gspo_ascend.env``: Ray runtime_env YAMLs and shell
profiles per hardware (npu/, gpu/, cpu/). Find them with ``importlib.resources.files("gspo_ascend.env")``.
"""
