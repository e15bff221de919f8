// classify_pt2: run a torchcls AOTInductor package without Python or model code.
//
//   classify_pt2 MODEL.pt2 PIXELS.f32
//
// PIXELS.f32 holds N images as raw little-endian float32 in N x C x H x W order, values in
// [0, 1], already resized to the model's input size. Everything else comes from the package's
// metadata (written by `torchcls export --target aoti`): channels, size, mean/std, the batch
// bound and the class names. The program normalises, runs the model and prints one JSON line
// per image: {"index": i, "top1": k, "label": "...", "logits": [...]}.
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

std::string require(const std::unordered_map<std::string, std::string>& meta, const std::string& key) {
  auto it = meta.find(key);
  if (it == meta.end()) {
    throw std::runtime_error("the package has no metadata key '" + key +
                             "': was it written by `torchcls export --target aoti`?");
  }
  return it->second;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, sep);) parts.push_back(item);
  return parts;
}

std::vector<float> read_floats(const std::string& path) {
  std::ifstream file(path, std::ios::binary | std::ios::ate);
  if (!file) throw std::runtime_error("cannot open " + path);
  std::streamsize bytes = file.tellg();
  if (bytes <= 0 || bytes % sizeof(float) != 0) throw std::runtime_error(path + " is not a float32 file");
  std::vector<float> values(bytes / sizeof(float));
  file.seekg(0);
  file.read(reinterpret_cast<char*>(values.data()), bytes);
  return values;
}

// "[0.5, 0.25]" or "0.5,0.25" -> {0.5, 0.25}
std::vector<float> parse_floats(std::string text) {
  for (char& c : text) {
    if (c == '[' || c == ']') c = ' ';
  }
  std::vector<float> out;
  for (const auto& part : split(text, ',')) out.push_back(std::stof(part));
  return out;
}

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

int run(const std::string& package, const std::string& pixels_path) {
  torch::inductor::AOTIModelPackageLoader loader(package);
  auto meta = loader.get_metadata();
  const int64_t channels = std::stoll(require(meta, "torchcls.channels"));
  const int64_t size = std::stoll(require(meta, "torchcls.img_size"));
  const int64_t max_batch = std::stoll(require(meta, "torchcls.max_batch"));
  const auto mean = parse_floats(require(meta, "torchcls.mean"));
  const auto stdev = parse_floats(require(meta, "torchcls.std"));
  const auto classes = split(require(meta, "torchcls.classes"), '\n');

  auto values = read_floats(pixels_path);
  const int64_t per_image = channels * size * size;
  if (static_cast<int64_t>(values.size()) % per_image != 0) {
    std::cerr << "error: " << pixels_path << " holds " << values.size() << " floats, not a multiple of "
              << channels << "x" << size << "x" << size << "\n";
    return 2;
  }
  const int64_t n = values.size() / per_image;
  // AOTInductor does not check the batch bound at run time: check it here.
  if (n < 1 || n > max_batch) {
    std::cerr << "error: " << n << " images, but this package accepts 1 to " << max_batch << "\n";
    return 2;
  }
  auto pixels = at::from_blob(values.data(), {n, channels, size, size}, at::kFloat).clone();
  auto mean_t = at::tensor(mean).view({1, channels, 1, 1});
  auto std_t = at::tensor(stdev).view({1, channels, 1, 1});
  auto x = (pixels - mean_t) / std_t;

  auto logits = loader.run({x})[0].to(at::kFloat).contiguous();
  auto top1 = logits.argmax(1);
  for (int64_t i = 0; i < n; ++i) {
    int64_t k = top1[i].item<int64_t>();
    std::printf("{\"index\": %lld, \"top1\": %lld, \"label\": \"%s\", \"logits\": [", static_cast<long long>(i),
                static_cast<long long>(k), json_escape(k < (int64_t)classes.size() ? classes[k] : "?").c_str());
    for (int64_t j = 0; j < logits.size(1); ++j) {
      std::printf("%s%.9g", j ? ", " : "", logits[i][j].item<float>());
    }
    std::printf("]}\n");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: classify_pt2 MODEL.pt2 PIXELS.f32\n"
                 "  PIXELS.f32: N x C x H x W float32 values in [0, 1] at the model's input size\n";
    return 2;
  }
  try {
    return run(argv[1], argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 2;
  }
}
