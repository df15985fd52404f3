"""Training objectives: language-model cross-entropy (SFT) and MTP objectives."""
