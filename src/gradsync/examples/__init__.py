"""A small GPT and a generated corpus: the model behind the main job and ``gradsync verify``."""
