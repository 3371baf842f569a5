"""Worker classes and models that run inside worker groups."""
