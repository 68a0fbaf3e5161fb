//! The PaddlePaddle custom-runtime plugin.
