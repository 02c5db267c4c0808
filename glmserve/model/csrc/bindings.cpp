// The Python module of the native kernels (glmserve/model/native_kernels.py); each kernel has its file.

#include <torch/extension.h>

torch::Tensor top_k_earliest(torch::Tensor scores, torch::Tensor lengths, int64_t k, bool ascending);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor paged_index_scores(torch::Tensor q, torch::Tensor weights, torch::Tensor keys, torch::Tensor tables,
                                 torch::Tensor positions);
torch::Tensor paged_latent_attention(torch::Tensor query, torch::Tensor view, torch::Tensor index,
                                     std::optional<torch::Tensor> allowed, int64_t latent_dim);
torch::Tensor pack_bf16_weight(torch::Tensor weight);
torch::Tensor bf16_weight_linear(torch::Tensor x, torch::Tensor packed, int64_t n_size);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("top_k_earliest", &top_k_earliest, "each row's k best scores, ties towards earlier positions");
  m.def("rms_norm", &rms_norm, "GLM's bfloat16 RMSNorm of the last dimension");
  m.def("rope", &rope, "rotary position embedding, interleaved pairs stored de-interleaved");
  m.def("paged_index_scores", &paged_index_scores, "the indexer's scores over keys in the paged cache");
  m.def("pack_bf16_weight", &pack_bf16_weight, "a weight as bfloat16 panels for bf16_weight_linear");
  m.def("bf16_weight_linear", &bf16_weight_linear, "float32 x @ W.T over bfloat16-stored weights");
  m.def("paged_latent_attention", &paged_latent_attention, "absorbed attention over selected rows of the paged cache");
}
