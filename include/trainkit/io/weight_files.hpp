#pragma once
// The weight files of other tools, read and written by name (weights.hpp is the public face):
//   safetensors   8-byte little-endian header length, a JSON header {name: {dtype, shape,
//                 data_offsets}}, then the tensors' bytes (huggingface/safetensors' format).
//   state_dict    what torch.save(model.state_dict(), path) writes: a zip holding data.pkl (a
//                 pickle of an OrderedDict of tensors) and data/<key> (each storage's bytes).
//                 Read by a small unpickler that understands exactly what torch.save puts there
//                 (LibTorch's torch::pickle_load drops an OrderedDict's items); written by a
//                 small pickler, as torch.save writes it, so torch.load(weights_only=True) opens
//                 it (torch::pickle_save's files need torch.jit globals that it refuses).
// Tensors come back on the CPU, in file order. Little-endian hosts only (as LibTorch).
#include <trainkit/archive/checkpoint_io.hpp>
#include <trainkit/archive/safetensors.hpp>

#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>
#include <torch/types.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace trainkit {

/// Tensors by name, in file (or model) order.
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

namespace detail {

// --- files ------------------------------------------------------------------------------------

inline std::string read_whole_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + what + " '" + path + "': " + std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error("cannot read " + what + " '" + path + "': " + std::strerror(errno));
  return bytes;
}

/// Writes `bytes` to `path` atomically (detail::write_atomically, as checkpoints are: a temporary
/// file, fsync, rename, the directory's fsync); `what` names the file in errors.
inline void write_file_atomically(const std::string& path, const std::string& what, const char* bytes, std::size_t n) {
  write_atomically(
      path, [&](const std::function<size_t(const void*, size_t)>& sink) { sink(bytes, n); }, what);
}

// --- safetensors ------------------------------------------------------------------------------

// (The dtype names and the writer: archive/safetensors.hpp, which checkpoint sets share.)

inline bool looks_like_safetensors(const std::string& head, std::uint64_t file_size) {
  if (head.size() < 9 || file_size < 10) return false;
  std::uint64_t n = 0;
  std::memcpy(&n, head.data(), 8);
  return n + 8 <= file_size && head[8] == '{';
}

inline NamedTensors read_safetensors(const std::string& path) {
  const std::string bytes = read_whole_file(path, "safetensors file");
  const auto bad = [&](const std::string& why) {
    return std::runtime_error("safetensors file '" + path + "' is damaged or not safetensors: " + why);
  };
  if (bytes.size() < 8) throw bad("shorter than its 8-byte header length");
  std::uint64_t header_size = 0;
  std::memcpy(&header_size, bytes.data(), 8);
  if (header_size > bytes.size() - 8) throw bad("its header length (" + std::to_string(header_size) + ") runs past the end");
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(header_size));
  } catch (const std::exception& e) {
    throw bad(std::string("its header is not JSON (") + e.what() + ")");
  }
  if (!header.is_object()) throw bad("its header is not a JSON object");
  const std::uint64_t data_size = bytes.size() - 8 - header_size;
  const char* data = bytes.data() + 8 + header_size;
  std::vector<std::pair<std::uint64_t, std::pair<std::string, torch::Tensor>>> found;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") continue;
    try {
      const std::string dtype = entry.at("dtype").get<std::string>();
      const auto shape = entry.at("shape").get<std::vector<std::int64_t>>();
      const auto offsets = entry.at("data_offsets").get<std::vector<std::uint64_t>>();
      const c10::ScalarType type = safetensors_scalar_type(dtype);
      if (type == c10::ScalarType::Undefined) throw bad("'" + name + "' has the dtype " + dtype + ", which trainkit does not read");
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size)
        throw bad("'" + name + "' has data_offsets outside the file's data");
      auto tensor = torch::empty(shape, torch::dtype(type));
      if (offsets[1] - offsets[0] != static_cast<std::uint64_t>(tensor.nbytes()))
        throw bad("'" + name + "' holds " + std::to_string(offsets[1] - offsets[0]) + " bytes, its shape and dtype need " +
                  std::to_string(tensor.nbytes()));
      if (tensor.nbytes() > 0) std::memcpy(tensor.data_ptr(), data + offsets[0], tensor.nbytes());
      found.push_back({offsets[0], {name, tensor}});
    } catch (const nlohmann::json::exception& e) {
      throw bad("the entry '" + name + "' is malformed (" + e.what() + ")");
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  NamedTensors out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

inline void write_safetensors(const std::string& path, const NamedTensors& tensors) {
  std::vector<torch::Tensor> contiguous;
  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : tensors) {
    const char* dtype = safetensors_dtype(t.scalar_type());
    if (dtype == nullptr)
      throw std::invalid_argument("cannot write '" + name + "' to safetensors file '" + path + "': dtype " +
                                  std::string(c10::toString(t.scalar_type())) + " has no safetensors name");
    contiguous.push_back(t.detach().to(torch::kCPU).contiguous());
    const auto& c = contiguous.back();
    entries.push_back({name, dtype, t.sizes().vec(), c.data_ptr(), static_cast<std::uint64_t>(c.nbytes())});
  }
  write_safetensors_file(path, {{"format", "pt"}}, entries, "safetensors file");
}

// --- torch.save's state_dict ------------------------------------------------------------------

/// A value of the pickle machine, reduced to what torch.save writes for a state_dict.
struct PickleValue;
using PickleList = std::vector<PickleValue>;
using PickleDict = std::vector<std::pair<PickleValue, PickleValue>>;
struct PickleGlobal {
  std::string module, name;
};
struct PickleStorage {
  c10::ScalarType type;
  std::string key;
  std::int64_t numel;
};
struct PickleValue {
  std::variant<std::monostate, bool, std::int64_t, double, std::string, PickleList, std::shared_ptr<PickleDict>, PickleGlobal,
               PickleStorage, torch::Tensor>
      v;
  bool is_tuple = false;  // a PickleList that was a tuple
};

/// The storage types torch.save names (torch.FloatStorage, ...) and their dtypes: read by the
/// unpickler, written by the pickler below.
struct StorageType {
  const char* name;
  c10::ScalarType type;
};
inline constexpr StorageType kStorageTypes[] = {
    {"DoubleStorage", c10::ScalarType::Double}, {"FloatStorage", c10::ScalarType::Float},
    {"HalfStorage", c10::ScalarType::Half},     {"BFloat16Storage", c10::ScalarType::BFloat16},
    {"LongStorage", c10::ScalarType::Long},     {"IntStorage", c10::ScalarType::Int},
    {"ShortStorage", c10::ScalarType::Short},   {"CharStorage", c10::ScalarType::Char},
    {"ByteStorage", c10::ScalarType::Byte},     {"BoolStorage", c10::ScalarType::Bool}};

inline c10::ScalarType storage_dtype(const std::string& name) {
  for (const auto& t : kStorageTypes)
    if (name == t.name) return t.type;
  return c10::ScalarType::Undefined;
}
inline const char* storage_name(c10::ScalarType type) {
  for (const auto& t : kStorageTypes)
    if (type == t.type) return t.name;
  return nullptr;
}

/// Runs the pickle program of a torch.save'd state_dict. Knows protocol 2-5's opcodes that
/// Python's pickler emits for dicts, tuples, numbers, strings and torch's tensor reductions;
/// anything else (an arbitrary object) is refused by name: only weights are read.
class StateDictUnpickler {
 public:
  StateDictUnpickler(std::string path, const std::string& program,
                     std::function<std::pair<const void*, std::size_t>(const std::string&)> storage_bytes)
      : path_(std::move(path)), p_(program), storage_bytes_(std::move(storage_bytes)) {}

  PickleValue run() {
    while (true) {
      if (pos_ >= p_.size()) fail("the pickle ends without STOP");
      const auto op = static_cast<unsigned char>(p_[pos_++]);
      switch (op) {
        case 0x80: pos_ += 1; break;                // PROTO
        case 0x95: pos_ += 8; break;                // FRAME
        case '.': return pop();                     // STOP
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case 'N': push({}); break;                  // NONE
        case 0x88: push(bool_value(true)); break;   // NEWTRUE
        case 0x89: push(bool_value(false)); break;  // NEWFALSE
        case 'K': push(int_value(read_uint(1))); break;    // BININT1
        case 'M': push(int_value(read_uint(2))); break;    // BININT2
        case 'J': push(int_value(static_cast<std::int32_t>(read_uint(4)))); break;  // BININT
        case 0x8a: {                                // LONG1
          const auto n = read_uint(1);
          if (n > 8) fail("an integer wider than 64 bits");
          std::uint64_t u = 0;
          for (std::uint64_t i = 0; i < n; ++i) u |= static_cast<std::uint64_t>(static_cast<unsigned char>(take(1)[0])) << (8 * i);
          if (n > 0 && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~std::uint64_t{0} << (8 * n);  // sign
          push(int_value(static_cast<std::int64_t>(u)));
          break;
        }
        case 'G': {                                 // BINFLOAT (big-endian)
          std::uint64_t u = 0;
          for (int i = 0; i < 8; ++i) u = (u << 8) | static_cast<unsigned char>(take(1)[0]);
          double d;
          std::memcpy(&d, &u, 8);
          PickleValue v;
          v.v = d;
          push(v);
          break;
        }
        case 'X': push(string_value(take(read_uint(4)))); break;      // BINUNICODE
        case 0x8c: push(string_value(take(read_uint(1)))); break;     // SHORT_BINUNICODE
        case 0x8d: push(string_value(take(read_uint(8)))); break;     // BINUNICODE8
        case 'C': push(string_value(take(read_uint(1)))); break;      // SHORT_BINBYTES
        case 'B': push(string_value(take(read_uint(4)))); break;      // BINBYTES
        case 'c': {                                  // GLOBAL "module\nname\n"
          const std::string module = line(), name = line();
          PickleValue v;
          v.v = PickleGlobal{module, name};
          push(v);
          break;
        }
        case 0x93: {                                 // STACK_GLOBAL
          const auto name = pop(), module = pop();
          PickleValue v;
          v.v = PickleGlobal{as_string(module), as_string(name)};
          push(v);
          break;
        }
        case ')': push(list_value({}, true)); break;  // EMPTY_TUPLE
        case ']': push(list_value({}, false)); break; // EMPTY_LIST
        case '}': {                                   // EMPTY_DICT
          PickleValue v;
          v.v = std::make_shared<PickleDict>();
          push(v);
          break;
        }
        case 't': push(list_value(pop_mark(), true)); break;  // TUPLE
        case 'l': push(list_value(pop_mark(), false)); break; // LIST
        case 0x85: case 0x86: case 0x87: {                    // TUPLE1..3
          const std::size_t n = op - 0x84;
          if (stack_.size() < n) fail("a tuple of more values than the stack holds");
          PickleList items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          push(list_value(std::move(items), true));
          break;
        }
        case 'a': {                                   // APPEND
          auto item = pop();
          list_of(top()).push_back(std::move(item));
          break;
        }
        case 'e': {                                   // APPENDS
          auto items = pop_mark();
          auto& list = list_of(top());
          list.insert(list.end(), items.begin(), items.end());
          break;
        }
        case 's': {                                   // SETITEM
          auto value = pop(), key = pop();
          dict_of(top()).push_back({std::move(key), std::move(value)});
          break;
        }
        case 'u': {                                   // SETITEMS
          auto items = pop_mark();
          if (items.size() % 2 != 0) fail("SETITEMS with an odd number of values");
          auto& dict = dict_of(top());
          for (std::size_t i = 0; i < items.size(); i += 2) dict.push_back({items[i], items[i + 1]});
          break;
        }
        case 'q': memo_[read_uint(1)] = top(); break;  // BINPUT
        case 'r': memo_[read_uint(4)] = top(); break;  // LONG_BINPUT
        case 0x94: memo_[memo_.size()] = top(); break; // MEMOIZE
        case 'h': push(memo(read_uint(1))); break;     // BINGET
        case 'j': push(memo(read_uint(4))); break;     // LONG_BINGET
        case 'Q': push(persistent(pop())); break;      // BINPERSID
        case 'R': {                                    // REDUCE
          auto args = pop(), callable = pop();
          push(reduce(callable, args));
          break;
        }
        case 'b': pop(); break;  // BUILD: an OrderedDict's attributes (_metadata): not weights
        case '0': pop(); break;  // POP
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", op);
          fail(std::string("pickle opcode ") + hex + " (not one that torch.save writes for a state_dict)");
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(const std::string& why) const {
    throw std::runtime_error("state_dict file '" + path_ + "': " + why + " at byte " + std::to_string(pos_) +
                             " of data.pkl; trainkit reads files of torch.save(model.state_dict(), path)");
  }
  std::string take(std::uint64_t n) {
    if (n > p_.size() - pos_) fail("the pickle ends inside a value");
    std::string s = p_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::uint64_t read_uint(int bytes) {
    const std::string b = take(static_cast<std::uint64_t>(bytes));
    std::uint64_t u = 0;
    for (int i = bytes - 1; i >= 0; --i) u = (u << 8) | static_cast<unsigned char>(b[static_cast<std::size_t>(i)]);
    return u;
  }
  std::string line() {
    const auto end = p_.find('\n', pos_);
    if (end == std::string::npos) fail("a GLOBAL without its newline");
    std::string s = p_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }
  static PickleValue bool_value(bool b) {
    PickleValue v;
    v.v = b;
    return v;
  }
  static PickleValue int_value(std::int64_t i) {
    PickleValue v;
    v.v = i;
    return v;
  }
  static PickleValue string_value(std::string s) {
    PickleValue v;
    v.v = std::move(s);
    return v;
  }
  static PickleValue list_value(PickleList items, bool tuple) {
    PickleValue v;
    v.v = std::move(items);
    v.is_tuple = tuple;
    return v;
  }
  void push(PickleValue v) { stack_.push_back(std::move(v)); }
  PickleValue pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) fail("a value taken from an empty stack");
    auto v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  PickleValue& top() {
    if (stack_.empty()) fail("an empty stack");
    return stack_.back();
  }
  PickleList pop_mark() {
    if (marks_.empty()) fail("no MARK");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    PickleList items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  PickleValue memo(std::uint64_t key) {
    const auto it = memo_.find(key);
    if (it == memo_.end()) fail("a memo entry that was never stored");
    return it->second;
  }
  PickleList& list_of(PickleValue& v) {
    if (auto* l = std::get_if<PickleList>(&v.v)) return *l;
    fail("APPEND to a value that is not a list");
  }
  PickleDict& dict_of(PickleValue& v) {
    if (auto* d = std::get_if<std::shared_ptr<PickleDict>>(&v.v)) return **d;
    fail("SETITEM on a value that is not a dict");
  }
  std::string as_string(const PickleValue& v) {
    if (const auto* s = std::get_if<std::string>(&v.v)) return *s;
    fail("a string expected");
  }
  std::int64_t as_int(const PickleValue& v) {
    if (const auto* i = std::get_if<std::int64_t>(&v.v)) return *i;
    if (const auto* b = std::get_if<bool>(&v.v)) return *b ? 1 : 0;
    fail("an integer expected");
  }
  std::vector<std::int64_t> as_ints(const PickleValue& v) {
    const auto* l = std::get_if<PickleList>(&v.v);
    if (l == nullptr) fail("a tuple of integers expected");
    std::vector<std::int64_t> out;
    for (const auto& x : *l) out.push_back(as_int(x));
    return out;
  }

  // ('storage', torch.FloatStorage, key, location, numel): a storage's bytes from data/<key>.
  PickleValue persistent(const PickleValue& id) {
    const auto* t = std::get_if<PickleList>(&id.v);
    if (t == nullptr || t->size() < 5 || as_string((*t)[0]) != "storage") fail("a persistent id that is not a storage");
    const auto* g = std::get_if<PickleGlobal>(&(*t)[1].v);
    if (g == nullptr) fail("a storage without its type");
    const auto type = storage_dtype(g->name);
    if (type == c10::ScalarType::Undefined) fail("a storage of type " + g->module + "." + g->name + ", which trainkit does not read");
    PickleValue v;
    v.v = PickleStorage{type, as_string((*t)[2]), as_int((*t)[4])};
    return v;
  }

  PickleValue reduce(const PickleValue& callable, const PickleValue& args) {
    const auto* g = std::get_if<PickleGlobal>(&callable.v);
    const auto* a = std::get_if<PickleList>(&args.v);
    if (g == nullptr || a == nullptr) fail("a REDUCE of something other than a named function");
    const std::string name = g->module + "." + g->name;
    if (name == "collections.OrderedDict") {
      PickleValue v;
      v.v = std::make_shared<PickleDict>();
      return v;
    }
    if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
      if (a->size() < 4) fail(name + " with " + std::to_string(a->size()) + " arguments");
      const auto* s = std::get_if<PickleStorage>(&(*a)[0].v);
      if (s == nullptr) fail(name + " without a storage");
      const auto offset = as_int((*a)[1]);
      const auto size = as_ints((*a)[2]), stride = as_ints((*a)[3]);
      const auto [bytes, n] = storage_bytes_(s->key);
      const auto element = static_cast<std::size_t>(c10::elementSize(s->type));
      if (n != static_cast<std::size_t>(s->numel) * element)
        fail("storage data/" + s->key + " holds " + std::to_string(n) + " bytes, its " + std::to_string(s->numel) +
             " elements need " + std::to_string(static_cast<std::size_t>(s->numel) * element));
      auto storage = torch::empty({s->numel}, torch::dtype(s->type));
      if (n > 0) std::memcpy(storage.data_ptr(), bytes, n);
      // The view torch saved, checked against the storage, then a tensor of its own.
      std::int64_t last = offset;
      for (std::size_t i = 0; i < size.size() && i < stride.size(); ++i)
        if (size[i] > 0) last += (size[i] - 1) * stride[i];
      if (size.size() != stride.size() || offset < 0 || (s->numel > 0 && last >= s->numel))
        fail("a tensor view outside its storage data/" + s->key);
      PickleValue v;
      v.v = storage.as_strided(size, stride, offset).clone();
      return v;
    }
    if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
      if (a->empty() || !std::holds_alternative<torch::Tensor>((*a)[0].v)) fail(name + " without its tensor");
      return (*a)[0];
    }
    fail("a call of " + name + " (only tensors and dicts of them are read)");
  }

  std::string path_;
  const std::string& p_;
  std::size_t pos_ = 0;
  std::function<std::pair<const void*, std::size_t>(const std::string&)> storage_bytes_;
  std::vector<PickleValue> stack_;
  std::vector<std::size_t> marks_;
  std::map<std::uint64_t, PickleValue> memo_;
};

/// The name -> tensor entries of a torch.save'd state_dict (zip format, PyTorch >= 1.6).
inline NamedTensors read_state_dict(const std::string& path) {
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  try {
    reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(path);
  } catch (const std::exception& e) {
    throw std::runtime_error("state_dict file '" + path + "' is not a zip archive of torch.save (" + first_line_of(e) +
                             "); files of torch.save before PyTorch 1.6 (_use_new_zipfile_serialization=False) are "
                             "not read: save them again with a recent PyTorch");
  }
  if (!reader->hasRecord("data.pkl")) throw std::runtime_error("state_dict file '" + path + "' holds no data.pkl record");
  const auto [pickle_data, pickle_size] = reader->getRecord("data.pkl");
  const std::string program(static_cast<const char*>(pickle_data.get()), pickle_size);
  std::map<std::string, std::pair<at::DataPtr, std::size_t>> storages;
  StateDictUnpickler unpickler(path, program, [&](const std::string& key) -> std::pair<const void*, std::size_t> {
    auto it = storages.find(key);
    if (it == storages.end()) {
      const std::string record = "data/" + key;
      if (!reader->hasRecord(record))
        throw std::runtime_error("state_dict file '" + path + "': the record " + record + " is missing");
      auto [data, size] = reader->getRecord(record);
      it = storages.emplace(key, std::make_pair(std::move(data), size)).first;
    }
    return {it->second.first.get(), it->second.second};
  });
  const PickleValue root = unpickler.run();
  const auto* dict = std::get_if<std::shared_ptr<PickleDict>>(&root.v);
  if (dict == nullptr)
    throw std::runtime_error("state_dict file '" + path + "' does not hold a dict (save model.state_dict(), not the model)");
  NamedTensors out;
  for (const auto& [key, value] : **dict) {
    const auto* name = std::get_if<std::string>(&key.v);
    const auto* tensor = std::get_if<torch::Tensor>(&value.v);
    if (name == nullptr || tensor == nullptr)
      throw std::runtime_error("state_dict file '" + path + "' holds an entry that is not name -> tensor" +
                               (name != nullptr ? " ('" + *name + "')" : std::string()));
    out.push_back({*name, *tensor});
  }
  return out;
}

/// The pickle program of torch.save for a dict name -> tensor, protocol 2, with only the globals
/// torch.load(weights_only=True) allows: torch._utils._rebuild_tensor_v2, torch.<Type>Storage and
/// collections.OrderedDict (torch::pickle_save adds torch.jit's type tags, which it refuses).
class StateDictPickler {
 public:
  std::string program(const NamedTensors& tensors, std::vector<torch::Tensor>& storages) {
    out_ = "\x80\x02}";  // PROTO 2, EMPTY_DICT
    if (!tensors.empty()) {
      out_ += '(';  // MARK
      for (const auto& [name, t] : tensors) {
        text(name);
        tensor(t, storages);
      }
      out_ += 'u';  // SETITEMS
    }
    out_ += '.';  // STOP
    return out_;
  }

 private:
  void text(const std::string& s) {
    out_ += 'X';  // BINUNICODE
    const auto n = static_cast<std::uint32_t>(s.size());
    out_.append(reinterpret_cast<const char*>(&n), 4);
    out_ += s;
  }
  void integer(std::int64_t v) {
    if (v >= 0 && v < 256) {
      out_ += 'K';  // BININT1
      out_ += static_cast<char>(v);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
      out_ += 'J';  // BININT
      const auto i = static_cast<std::int32_t>(v);
      out_.append(reinterpret_cast<const char*>(&i), 4);
    } else {
      out_ += "\x8a\x08";  // LONG1, 8 bytes
      out_.append(reinterpret_cast<const char*>(&v), 8);
    }
  }
  void ints(c10::IntArrayRef values) {
    if (values.empty()) {
      out_ += ')';  // EMPTY_TUPLE
      return;
    }
    out_ += '(';
    for (const auto v : values) integer(v);
    out_ += 't';
  }
  void global(const char* module, const std::string& name) { out_ += std::string("c") + module + "\n" + name + "\n"; }
  void tensor(const torch::Tensor& t, std::vector<torch::Tensor>& storages) {
    const char* storage = storage_name(t.scalar_type());
    if (storage == nullptr)
      throw std::invalid_argument(std::string("cannot write a ") + c10::toString(t.scalar_type()) + " tensor to a state_dict file");
    const std::string key = std::to_string(storages.size());
    storages.push_back(t);
    global("torch._utils", "_rebuild_tensor_v2");
    out_ += '(';  // the arguments: storage, offset, size, stride, requires_grad, backward_hooks
    out_ += '(';  // the persistent id: ('storage', type, key, location, numel)
    text("storage");
    global("torch", storage);
    text(key);
    text("cpu");
    integer(t.numel());
    out_ += "tQ";  // TUPLE, BINPERSID
    integer(0);
    ints(t.sizes());
    ints(t.strides());
    out_ += '\x89';  // NEWFALSE
    global("collections", "OrderedDict");
    out_ += ")R";  // OrderedDict()
    out_ += "tR";  // TUPLE, REDUCE
  }

  std::string out_;
};

/// torch.save's format: a zip of data.pkl (StateDictPickler), byteorder and data/<key> per
/// tensor (CPU, contiguous), written atomically.
inline void write_state_dict(const std::string& path, const NamedTensors& tensors) {
  NamedTensors contiguous;
  for (const auto& [name, t] : tensors) contiguous.push_back({name, t.detach().to(torch::kCPU).contiguous()});
  std::vector<torch::Tensor> storages;
  const std::string program = StateDictPickler().program(contiguous, storages);
  std::string bytes;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t n) {
      bytes.append(static_cast<const char*>(data), n);
      return n;
    });
    writer.writeRecord("data.pkl", program.data(), program.size());
    writer.writeRecord("byteorder", "little", 6);
    for (std::size_t i = 0; i < storages.size(); ++i)
      writer.writeRecord("data/" + std::to_string(i), storages[i].data_ptr(), storages[i].nbytes());
    writer.writeEndOfFile();
  }
  write_file_atomically(path, "state_dict file", bytes.data(), bytes.size());
}

}  // namespace detail
}  // namespace trainkit
