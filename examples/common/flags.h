// Tiny flag parsing shared by the examples: --name=value or --name value,
// repeated flags collect, unknown flags are an error naming the flag.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace rdmarpc::examples {

class Flags {
 public:
  // `known`: flag names without dashes. Returns false (and prints why) on a bad flag.
  bool Parse(int argc, char** argv, const std::vector<std::string>& known, const char* usage) {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::fputs(usage, stdout);
        help_ = true;
        return false;
      }
      if (a.rfind("--", 0) != 0) {
        positional_.push_back(a);
        continue;
      }
      std::string name = a.substr(2), value;
      if (auto eq = name.find('='); eq != std::string::npos) {
        value = name.substr(eq + 1);
        name = name.substr(0, eq);
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        std::fprintf(stderr, "flag --%s needs a value\n%s", name.c_str(), usage);
        return false;
      }
      bool ok = false;
      for (const auto& k : known) ok = ok || k == name;
      if (!ok) {
        std::fprintf(stderr, "unknown flag --%s\n%s", name.c_str(), usage);
        return false;
      }
      values_[name].push_back(value);
    }
    return true;
  }
  bool help() const { return help_; }
  std::string Get(const std::string& name, const std::string& fallback = "") const {
    auto it = values_.find(name);
    return it == values_.end() ? fallback : it->second.back();
  }
  std::vector<std::string> All(const std::string& name) const {
    auto it = values_.find(name);
    return it == values_.end() ? std::vector<std::string>{} : it->second;
  }
  // Parses an unsigned flag; false (with a message) if it is not a number.
  bool GetUint(const std::string& name, unsigned long long fallback, unsigned long long* out) const {
    std::string v = Get(name);
    if (v.empty()) {
      *out = fallback;
      return true;
    }
    char* end = nullptr;
    *out = std::strtoull(v.c_str(), &end, 10);
    if (end == v.c_str() || *end != '\0') {
      std::fprintf(stderr, "--%s=%s: not a number\n", name.c_str(), v.c_str());
      return false;
    }
    return true;
  }
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::map<std::string, std::vector<std::string>> values_;
  std::vector<std::string> positional_;
  bool help_ = false;
};

}  // namespace rdmarpc::examples
