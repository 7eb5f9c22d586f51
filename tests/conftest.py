import os

# Nothing may come from the Hugging Face Hub: the project reads only local files and packaged corpora.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
