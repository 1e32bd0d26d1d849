"""Model families in plain PyTorch with Hugging Face state-dict names, their building blocks and weight loading."""
