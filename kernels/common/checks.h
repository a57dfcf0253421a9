// Host-side argument checks that build readable messages: "<op>: <what> <expected>, got <actual>".
#pragma once
#include <sstream>
#include <string>

#include "common/types.h"

namespace xla_attn {

class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}
  // Records the first failure only; later checks are skipped so a message never
  // blames an argument for an earlier one's fault.
  template <typename... Parts>
  Checker& expect(bool ok, const Parts&... parts) {
    if (!ok && error_.empty()) {
      std::ostringstream os;
      os << op_ << ": ";
      (os << ... << parts);
      error_ = os.str();
    }
    return *this;
  }
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  const char* op_;
  std::string error_;
};

inline bool is_float_dtype(xla_attn_dtype d) {
  return d == XLA_ATTN_F32 || d == XLA_ATTN_F16 || d == XLA_ATTN_BF16;
}
inline bool is_fp8_dtype(xla_attn_dtype d) { return d == XLA_ATTN_F8E4M3 || d == XLA_ATTN_F8E5M2; }

// Head dims the library supports: the contract says up to 256.
constexpr int kMaxHeadDim = 256;

}  // namespace xla_attn
