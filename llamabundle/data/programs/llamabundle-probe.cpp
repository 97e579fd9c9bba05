// llamabundle-probe: which ggml backends of this bundle load on this machine, why the others do not, and the
// devices they find, as one JSON object on stdout (schema: llamabundle/data/llamabundle-probe.schema.json).
//
// Written into the build tree by llamabundle and built beside llama-server (build.py: PROBE_PROGRAM), linked
// to ggml only. It does what llama-server's ggml_backend_load_all_from_path does with the backend modules of
// its own directory (for each backend name, the variant of best ggml_backend_score, else the plain module),
// with two differences that make its answer complete: each module is first opened with the platform's loader
// itself, so that a module that does not load has the loader's own words (dlerror; on Windows the system
// message of GetLastError and, for error 126, the imported DLL that is missing), and ggml's log goes to a
// callback of ours, called synchronously (no log thread: no line is lost at exit). It reads no model and
// allocates nothing on a device. Exit 0 whenever it printed its JSON; 2 for a bad argument.
//
// `--drivers` asks the machine's GPU drivers themselves instead, without any ggml backend module (a partial
// install that holds only the CPU part of a bundle learns which GPU backends it could run): the NVIDIA driver
// (libcuda.so.1, nvcuda.dll: its version and its devices with their compute capabilities, PCI bus ids and
// memory) and the Vulkan loader (libvulkan.so.1, vulkan-1.dll: the physical devices and their types). Each is
// opened by name from the system's own places, its functions declared here (no CUDA or Vulkan headers are
// needed to build it); a library that does not open is reported with the loader's words, a function it lacks
// is named and never called, device counts are bounded, and what a driver writes on stdout goes to stderr.
//
// `--rpc HOST:PORT[,HOST:PORT...]` also asks each RPC server an app configured, as ggml's client does (a TCP
// connection, HELLO, DEVICE_COUNT; nothing else is sent), and reports it with a reason code (rpc_ok,
// rpc_unreachable, rpc_not_rpc, rpc_version_mismatch, rpc_no_devices, rpc_endpoint_invalid, rpc_backend_missing:
// reasons.json's "rpc"). The servers that answered are then added as llama-server --rpc adds them, so their devices
// (RPC0, ...) are listed: at the pinned commit ggml aborts on a server it cannot use, so no other is given to it.
#include "ggml-backend.h"
#include "ggml.h"

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#ifdef _WIN32
#    define WIN32_LEAN_AND_MEAN
#    ifndef NOMINMAX
#        define NOMINMAX
#    endif
#    include <winsock2.h>
#    include <ws2tcpip.h>
#    include <windows.h>
#    include <fstream>
#    include <io.h>
#else
#    include <dlfcn.h>
#    include <netdb.h>
#    include <poll.h>
#    include <sys/socket.h>
#    include <sys/time.h>
#    include <unistd.h>
#    include <fcntl.h>
#    include <cerrno>
#    ifdef __linux__
#        include <link.h>
#    endif
#endif

namespace fs = std::filesystem;

namespace {

// ggml_backend_load_all_from_path's order (ggml-backend-reg.cpp)
const char * const BACKENDS[] = {"blas", "zendnn", "cann", "cuda", "hip", "metal", "rpc", "sycl", "vulkan",
                                 "virtgpu", "opencl", "hexagon", "musa", "openvino", "cpu"};

std::string json_str(const std::string & s) {
    std::string out = "\"";
    for (unsigned char c : s) {
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\r': out += "\\r"; break;
            case '\t': out += "\\t"; break;
            default:
                if (c < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "\\u%04x", c);
                    out += buf;
                } else {
                    out += static_cast<char>(c);
                }
        }
    }
    return out + "\"";
}

std::string json_opt(const char * s) { return s ? json_str(s) : "null"; }

std::string trim(std::string s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
    size_t i = 0;
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) i++;
    return s.substr(i);
}

// ggml's log, line by line (a message may come in pieces: GGML_LOG_CONT)
struct Log {
    std::vector<std::pair<std::string, std::string>> lines;  // level, text
    std::string pending, pending_level = "info";
};

const char * level_name(ggml_log_level level) {
    switch (level) {
        case GGML_LOG_LEVEL_DEBUG: return "debug";
        case GGML_LOG_LEVEL_WARN: return "warn";
        case GGML_LOG_LEVEL_ERROR: return "error";
        default: return "info";
    }
}

void on_log(ggml_log_level level, const char * text, void * user) {
    auto * log = static_cast<Log *>(user);
    if (level != GGML_LOG_LEVEL_CONT) log->pending_level = level_name(level);
    log->pending += text ? text : "";
    size_t nl;
    while ((nl = log->pending.find('\n')) != std::string::npos) {
        std::string line = trim(log->pending.substr(0, nl));
        if (!line.empty()) log->lines.emplace_back(log->pending_level, line);
        log->pending.erase(0, nl + 1);
    }
}

#ifdef _WIN32
const char * PREFIX = "ggml-";
const char * EXT = ".dll";

std::string narrow(const std::wstring & w) {
    if (w.empty()) return {};
    int n = WideCharToMultiByte(CP_UTF8, 0, w.c_str(), (int) w.size(), nullptr, 0, nullptr, nullptr);
    std::string s(n, '\0');
    WideCharToMultiByte(CP_UTF8, 0, w.c_str(), (int) w.size(), s.data(), n, nullptr, nullptr);
    return s;
}

std::string system_message(DWORD code) {
    wchar_t * buf = nullptr;
    DWORD n = FormatMessageW(FORMAT_MESSAGE_ALLOCATE_BUFFER | FORMAT_MESSAGE_FROM_SYSTEM | FORMAT_MESSAGE_IGNORE_INSERTS,
                             nullptr, code, 0, reinterpret_cast<wchar_t *>(&buf), 0, nullptr);
    std::string text = n ? trim(narrow(std::wstring(buf, n))) : std::string();
    if (buf) LocalFree(buf);
    return "error " + std::to_string(code) + (text.empty() ? "" : ": " + text);
}

// The DLL names a PE file imports (its import directory), read from the file: for error 126, which is missing.
std::vector<std::string> pe_imports(const fs::path & path) {
    std::vector<std::string> out;
    std::ifstream f(path, std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    auto u16 = [&](size_t o) -> uint32_t { return o + 2 <= data.size() ? (uint8_t) data[o] | (uint8_t) data[o + 1] << 8 : 0; };
    auto u32 = [&](size_t o) -> uint32_t { return o + 4 <= data.size() ? u16(o) | u16(o + 2) << 16 : 0; };
    uint32_t pe = u32(0x3c);
    if (data.size() < 0x40 || u32(pe) != 0x4550) return out;
    uint32_t nsec = u16(pe + 6), optsize = u16(pe + 20), opt = pe + 24;
    uint32_t magic = u16(opt);
    uint32_t dirs = opt + (magic == 0x20b ? 112 : 96);
    uint32_t import_rva = u32(dirs + 8);
    uint32_t sec = opt + optsize;
    auto offset = [&](uint32_t rva) -> size_t {
        for (uint32_t i = 0; i < nsec; i++) {
            uint32_t s = sec + i * 40, va = u32(s + 12), vsize = std::max(u32(s + 8), u32(s + 16)), raw = u32(s + 20);
            if (rva >= va && rva < va + vsize) return raw + (rva - va);
        }
        return 0;
    };
    size_t d = import_rva ? offset(import_rva) : 0;
    for (int i = 0; d && i < 4096; i++, d += 20) {
        uint32_t name_rva = u32(d + 12);
        if (!name_rva) break;
        size_t n = offset(name_rva);
        std::string name;
        while (n && n < data.size() && data[n] && name.size() < 260) name += data[n++];
        if (!name.empty()) out.push_back(name);
    }
    return out;
}

void * open_module(const fs::path & path, std::string & error) {
    UINT old = SetErrorMode(SEM_FAILCRITICALERRORS);
    SetErrorMode(old | SEM_FAILCRITICALERRORS);
    HMODULE h = LoadLibraryW(path.wstring().c_str());  // as ggml opens it (ggml-backend-dl.cpp)
    DWORD code = h ? 0 : GetLastError();
    if (!h) {
        error = system_message(code);
        if (code == ERROR_MOD_NOT_FOUND) {  // which import: the first that does not load from here either
            std::vector<std::string> missing;
            for (const auto & name : pe_imports(path)) {
                fs::path beside = path.parent_path() / fs::u8path(name);
                HMODULE dep = LoadLibraryW((fs::exists(beside) ? beside : fs::u8path(name)).wstring().c_str());
                if (dep) FreeLibrary(dep); else missing.push_back(name);
            }
            for (size_t i = 0; i < missing.size(); i++) error += (i ? ", " : " (missing: ") + missing[i];
            if (!missing.empty()) error += ")";
        }
    }
    SetErrorMode(old);
    return h;
}

void * symbol(void * h, const char * name) { return reinterpret_cast<void *>(GetProcAddress((HMODULE) h, name)); }
void close_module(void * h) { FreeLibrary((HMODULE) h); }

// A driver's library by name, from System32 only (where the driver installs it): never a copy beside the program.
void * open_system_library(const char * name, std::string & error) {
    UINT old = SetErrorMode(SEM_FAILCRITICALERRORS);
    SetErrorMode(old | SEM_FAILCRITICALERRORS);
    HMODULE h = LoadLibraryExW(fs::u8path(name).wstring().c_str(), nullptr, LOAD_LIBRARY_SEARCH_SYSTEM32);
    if (!h) error = system_message(GetLastError());
    SetErrorMode(old);
    return h;
}

std::string library_path(void * h) {
    std::wstring buf(32768, L'\0');
    DWORD n = GetModuleFileNameW((HMODULE) h, buf.data(), (DWORD) buf.size());
    buf.resize(n);
    return narrow(buf);
}

fs::path executable_dir() {
    std::wstring buf(32768, L'\0');
    DWORD n = GetModuleFileNameW(nullptr, buf.data(), (DWORD) buf.size());
    buf.resize(n);
    return fs::path(buf).parent_path();
}
std::string path_str(const fs::path & p) { return narrow(p.wstring()); }
#else
const char * PREFIX = "libggml-";
const char * EXT = ".so";

void * open_module(const fs::path & path, std::string & error) {
    dlerror();
    void * h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);  // as ggml opens it (ggml-backend-dl.cpp)
    if (!h) {
        const char * e = dlerror();
        error = e ? e : "dlopen failed";
    }
    return h;
}

void * symbol(void * h, const char * name) { return dlsym(h, name); }
void close_module(void * h) { dlclose(h); }

// A driver's library by name, as the loader finds it (LD_LIBRARY_PATH, the ld.so cache, the system's
// directories; a bundle never holds libcuda.so.1 or libvulkan.so.1).
void * open_system_library(const char * name, std::string & error) { return open_module(name, error); }

std::string library_path(void * h) {
#    ifdef __linux__
    struct link_map * map = nullptr;
    if (dlinfo(h, RTLD_DI_LINKMAP, &map) == 0 && map && map->l_name) return map->l_name;
#    endif
    (void) h;
    return "";
}

fs::path executable_dir() {
    std::error_code ec;
    fs::path p = fs::read_symlink("/proc/self/exe", ec);
    return ec ? fs::current_path() : p.parent_path();
}
std::string path_str(const fs::path & p) { return p.string(); }
#endif

struct Module {
    std::string file, backend, variant;
    bool opened = false, chosen = false, loaded = false;
    std::string error;       // the loader's words when it did not open
    bool has_score = false;
    int score = 0;
    std::string outcome;     // loaded | not_opened | unsupported | not_chosen | no_score | refused
    std::string registered;  // the backend name ggml registered
    std::vector<std::string> log;  // what ggml logged while loading it
};

const char * type_name(enum ggml_backend_dev_type t) {
    switch (t) {
        case GGML_BACKEND_DEVICE_TYPE_CPU: return "cpu";
        case GGML_BACKEND_DEVICE_TYPE_GPU: return "gpu";
        case GGML_BACKEND_DEVICE_TYPE_IGPU: return "igpu";
        case GGML_BACKEND_DEVICE_TYPE_ACCEL: return "accel";
        default: return "unknown";
    }
}

// What ggml-cuda logs of a device when it starts ("  Device 0: NVIDIA H200, compute capability 9.0, VMM: yes, …"):
// the compute capability of CUDA device `index`, "" where it logged none.
std::string compute_capability(const Log & log, size_t index) {
    const std::string head = "Device " + std::to_string(index) + ": ";
    const std::string cc = ", compute capability ";
    for (const auto & line : log.lines) {
        if (line.second.rfind(head, 0) != 0) continue;
        size_t at = line.second.find(cc);
        if (at == std::string::npos) continue;
        std::string v;
        for (size_t i = at + cc.size(); i < line.second.size() && (std::isdigit((unsigned char) line.second[i]) || line.second[i] == '.'); i++) {
            v += line.second[i];
        }
        return v;
    }
    return "";
}

// --drivers: the GPU drivers themselves, asked without ggml

#ifdef _WIN32
#    define DRIVER_API __stdcall  // CUDAAPI and VKAPI_PTR on Windows
const char * const CUDA_LIBRARY = "nvcuda.dll";
const char * const VULKAN_LIBRARY = "vulkan-1.dll";
int dup_fd(int fd) { return _dup(fd); }
int dup2_fd(int from, int to) { return _dup2(from, to); }
void close_fd(int fd) { _close(fd); }
#else
#    define DRIVER_API
const char * const CUDA_LIBRARY = "libcuda.so.1";
const char * const VULKAN_LIBRARY = "libvulkan.so.1";
int dup_fd(int fd) { return dup(fd); }
int dup2_fd(int from, int to) { return dup2(from, to); }
void close_fd(int fd) { close(fd); }
#endif

const int MAX_DRIVER_DEVICES = 64;  // what a driver says of more is not listed (a problem says how many it said)
const size_t MAX_DRIVER_STRING = 256;  // a name a driver gives is read up to its NUL or this many bytes

// A driver's string as valid UTF-8 (a byte that is not is replaced by U+FFFD), read up to its NUL or `max`
// bytes: JSON text must be UTF-8, and a driver's buffer may hold anything.
std::string utf8(const char * s, size_t max = MAX_DRIVER_STRING) {
    std::string out;
    if (!s) return out;
    size_t n = 0;
    while (n < max && s[n]) n++;
    const auto * b = reinterpret_cast<const unsigned char *>(s);
    for (size_t i = 0; i < n;) {
        unsigned char c = b[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
        bool ok = len && i + len <= n;
        for (size_t k = 1; ok && k < len; k++) ok = (b[i + k] & 0xc0) == 0x80;
        if (ok && len > 1) {  // no overlong form, surrogate or code point past U+10FFFF
            uint32_t cp = len == 2 ? (c & 0x1f) << 6 | (b[i + 1] & 0x3f)
                        : len == 3 ? (c & 0x0f) << 12 | (b[i + 1] & 0x3f) << 6 | (b[i + 2] & 0x3f)
                                   : (c & 0x07) << 18 | (b[i + 1] & 0x3f) << 12 | (b[i + 2] & 0x3f) << 6 | (b[i + 3] & 0x3f);
            ok = cp >= (len == 2 ? 0x80u : len == 3 ? 0x800u : 0x10000u) && cp <= 0x10ffff && (cp < 0xd800 || cp > 0xdfff);
        }
        if (ok) {
            out.append(s + i, len);
            i += len;
        } else {
            out += "\xef\xbf\xbd";
            i++;
        }
    }
    return out;
}

std::string utf8(const std::string & s) { return utf8(s.c_str(), s.size()); }

std::string json_list(const std::vector<std::string> & items) {
    std::string out = "[";
    for (size_t i = 0; i < items.size(); i++) out += (i ? ", " : "") + json_str(utf8(items[i]));
    return out + "]";
}

std::string json_int(bool known, long long v) { return known ? std::to_string(v) : "null"; }

// What a driver writes on stdout while it is asked goes to stderr: stdout holds our one JSON object only.
struct StdoutToStderr {
    int saved = -1;
    StdoutToStderr() {
        std::fflush(stdout);
        saved = dup_fd(1);
        if (saved >= 0 && dup2_fd(2, 1) < 0) {
            close_fd(saved);
            saved = -1;
        }
    }
    ~StdoutToStderr() {
        if (saved < 0) return;
        std::fflush(stdout);
        dup2_fd(saved, 1);
        close_fd(saved);
    }
};

// One driver library as opened: what every driver's JSON object starts with.
struct Library {
    const char * name;
    void * handle = nullptr;
    std::string error, path;
    std::vector<std::string> missing, problems;

    explicit Library(const char * n) : name(n) {
        handle = open_system_library(n, error);
        // the driver is never closed: its threads may outlive the queries, and the program exits next
        if (handle) path = library_path(handle);
    }
    void * need(const char * symbol_name) {
        void * f = handle ? symbol(handle, symbol_name) : nullptr;
        if (handle && !f) missing.push_back(symbol_name);
        return f;
    }
    std::string json_head() const {
        return "\"library\": " + json_str(name) + ", \"opened\": " + (handle ? "true" : "false") +
               ", \"error\": " + (handle ? std::string("null") : json_str(utf8(error))) +
               ", \"path\": " + (path.empty() ? std::string("null") : json_str(utf8(path))) +
               ", \"missing\": " + json_list(missing);
    }
};

// The NVIDIA driver's API, as cuda.h declares it (CUresult and CUdevice are int)
using cuInit_t = int(DRIVER_API *)(unsigned int);
using cuDriverGetVersion_t = int(DRIVER_API *)(int *);
using cuDeviceGetCount_t = int(DRIVER_API *)(int *);
using cuDeviceGet_t = int(DRIVER_API *)(int *, int);
using cuDeviceGetName_t = int(DRIVER_API *)(char *, int, int);
using cuDeviceGetAttribute_t = int(DRIVER_API *)(int *, int, int);
using cuDeviceTotalMem_t = int(DRIVER_API *)(size_t *, int);
using cuGetErrorName_t = int(DRIVER_API *)(int, const char **);
enum {
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
};

std::string cuda_driver() {
    Library lib(CUDA_LIBRARY);
    auto init = reinterpret_cast<cuInit_t>(lib.need("cuInit"));
    auto driver_version = reinterpret_cast<cuDriverGetVersion_t>(lib.need("cuDriverGetVersion"));
    auto device_count = reinterpret_cast<cuDeviceGetCount_t>(lib.need("cuDeviceGetCount"));
    auto device_get = reinterpret_cast<cuDeviceGet_t>(lib.need("cuDeviceGet"));
    auto device_name = reinterpret_cast<cuDeviceGetName_t>(lib.need("cuDeviceGetName"));
    auto attribute = reinterpret_cast<cuDeviceGetAttribute_t>(lib.need("cuDeviceGetAttribute"));
    // cuDeviceTotalMem is the 32-bit one of CUDA 3.1 and before: given a zeroed 64-bit value, it fills the low half
    auto total_mem = reinterpret_cast<cuDeviceTotalMem_t>(lib.handle ? symbol(lib.handle, "cuDeviceTotalMem_v2") : nullptr);
    if (!total_mem) total_mem = reinterpret_cast<cuDeviceTotalMem_t>(lib.need("cuDeviceTotalMem"));
    if (lib.handle && !total_mem) lib.missing.back() = "cuDeviceTotalMem_v2";
    auto error_name = reinterpret_cast<cuGetErrorName_t>(lib.handle ? symbol(lib.handle, "cuGetErrorName") : nullptr);

    auto name_of = [&](int code) -> std::string {
        const char * s = nullptr;
        if (error_name && error_name(code, &s) == 0 && s) return utf8(s);
        return "";
    };
    auto failed = [&](const char * call, int code) {
        std::string n = name_of(code);
        lib.problems.push_back(std::string(call) + " returned " + std::to_string(code) + (n.empty() ? "" : " (" + n + ")"));
    };

    bool have_init = false, have_version = false, have_count = false;
    int init_result = 0, version = 0, count = 0;
    if (init) {
        have_init = true;
        init_result = init(0);
    }
    if (driver_version) {
        int r = driver_version(&version);
        if (r == 0) have_version = true; else failed("cuDriverGetVersion", r);
    }
    std::string devices;
    if (have_init && init_result == 0 && device_count) {
        int r = device_count(&count);
        if (r == 0) have_count = true; else failed("cuDeviceGetCount", r);
    }
    int listed = have_count && device_get ? std::max(0, std::min(count, MAX_DRIVER_DEVICES)) : 0;
    if (have_count && count > MAX_DRIVER_DEVICES) {
        lib.problems.push_back("cuDeviceGetCount said " + std::to_string(count) + " devices: the first " +
                               std::to_string(MAX_DRIVER_DEVICES) + " are listed");
    }
    for (int i = 0; i < listed; i++) {
        int dev = 0;
        int r = device_get(&dev, i);
        if (r != 0) {
            failed(("cuDeviceGet(" + std::to_string(i) + ")").c_str(), r);
            continue;
        }
        std::string name;
        if (device_name) {
            char buf[MAX_DRIVER_STRING + 1] = {};
            if ((r = device_name(buf, (int) MAX_DRIVER_STRING, dev)) == 0) name = utf8(buf); else failed("cuDeviceGetName", r);
        }
        auto attr = [&](int which, int & out) {
            return attribute && attribute(&out, which, dev) == 0;
        };
        int major = 0, minor = 0, domain = 0, bus = 0, slot = 0;
        std::string cc, bus_id;
        if (attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, major) && attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, minor)) {
            cc = std::to_string(major) + "." + std::to_string(minor);
        }
        if (attr(CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, domain) && attr(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, bus) &&
            attr(CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, slot)) {
            char buf[64];
            std::snprintf(buf, sizeof buf, "%04x:%02x:%02x.0", (unsigned) domain, (unsigned) bus, (unsigned) slot);
            bus_id = buf;  // as ggml-cuda's device_id
        }
        uint64_t memory = 0;
        size_t bytes[2] = {0, 0};  // room for a driver that writes more than it should
        bool have_memory = total_mem && (r = total_mem(bytes, dev)) == 0;
        if (total_mem && !have_memory) failed("cuDeviceTotalMem", r);
        memory = bytes[0];
        devices += devices.empty() ? "\n        {" : ",\n        {";
        devices += "\"index\": " + std::to_string(i) + ", \"name\": " + (name.empty() ? std::string("null") : json_str(name));
        devices += ", \"compute_capability\": " + (cc.empty() ? std::string("null") : json_str(cc));
        devices += ", \"device_id\": " + (bus_id.empty() ? std::string("null") : json_str(bus_id));
        devices += ", \"memory_total\": " + json_int(have_memory, (long long) memory) + "}";
    }

    std::string init_error = have_init && init_result != 0 ? name_of(init_result) : "";
    std::string out = "{\n      " + lib.json_head();
    out += ",\n      \"init\": " + json_int(have_init, init_result);
    out += ", \"init_error\": " + (init_error.empty() ? std::string("null") : json_str(init_error));
    out += ", \"driver_version\": " + json_int(have_version, version);
    out += ", \"cuda_version\": " + (have_version ? json_str(std::to_string(version / 1000) + "." + std::to_string(version % 1000 / 10)) : "null");
    out += ", \"device_count\": " + json_int(have_count, count);
    out += ",\n      \"devices\": [" + devices + (devices.empty() ? "]" : "\n      ]");
    out += ",\n      \"problems\": " + json_list(lib.problems) + "\n    }";
    return out;
}

// The Vulkan loader's API: the handful of types it needs, as vulkan_core.h lays them out
using VkInstance = void *;
using VkPhysicalDevice = void *;
using PFN_vkVoidFunction = void(DRIVER_API *)();
using PFN_vkGetInstanceProcAddr = PFN_vkVoidFunction(DRIVER_API *)(VkInstance, const char *);
struct VkApplicationInfo {
    int32_t sType;  // VK_STRUCTURE_TYPE_APPLICATION_INFO = 0
    const void * pNext;
    const char * pApplicationName;
    uint32_t applicationVersion;
    const char * pEngineName;
    uint32_t engineVersion;
    uint32_t apiVersion;
};
struct VkInstanceCreateInfo {
    int32_t sType;  // VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO = 1
    const void * pNext;
    uint32_t flags;
    const VkApplicationInfo * pApplicationInfo;
    uint32_t enabledLayerCount;
    const char * const * ppEnabledLayerNames;
    uint32_t enabledExtensionCount;
    const char * const * ppEnabledExtensionNames;
};
using PFN_vkCreateInstance = int32_t(DRIVER_API *)(const VkInstanceCreateInfo *, const void *, VkInstance *);
using PFN_vkDestroyInstance = void(DRIVER_API *)(VkInstance, const void *);
using PFN_vkEnumeratePhysicalDevices = int32_t(DRIVER_API *)(VkInstance, uint32_t *, VkPhysicalDevice *);
using PFN_vkGetPhysicalDeviceProperties = void(DRIVER_API *)(VkPhysicalDevice, void *);
// VkPhysicalDeviceProperties: apiVersion, driverVersion, vendorID, deviceID (uint32_t each), deviceType (an enum:
// int32_t), deviceName[VK_MAX_PHYSICAL_DEVICE_NAME_SIZE = 256], then the UUID, limits and sparse properties
// (824 bytes on x86-64); filled into a zeroed buffer five times larger
const size_t VK_PROPERTIES_SIZE = 4096, VK_API_VERSION = 0, VK_VENDOR_ID = 8, VK_DEVICE_TYPE = 16, VK_DEVICE_NAME = 20;
const char * const VK_DEVICE_TYPES[] = {"other", "integrated_gpu", "discrete_gpu", "virtual_gpu", "cpu"};

std::string vulkan_driver() {
    Library lib(VULKAN_LIBRARY);
    auto gipa = reinterpret_cast<PFN_vkGetInstanceProcAddr>(lib.need("vkGetInstanceProcAddr"));
    auto resolve = [&](VkInstance instance, const char * name) -> void * {
        auto f = reinterpret_cast<void *>(gipa(instance, name));
        if (!f) lib.missing.push_back(name);
        return f;
    };
    auto create = gipa ? reinterpret_cast<PFN_vkCreateInstance>(resolve(nullptr, "vkCreateInstance")) : nullptr;

    bool have_create = false, have_count = false;
    int32_t created = 0;
    uint32_t count = 0;
    std::string devices;
    if (create) {
        VkApplicationInfo app{};
        app.sType = 0;
        app.pApplicationName = "llamabundle-probe";
        app.apiVersion = 1u << 22;  // Vulkan 1.0: every loader and driver takes it
        VkInstanceCreateInfo info{};
        info.sType = 1;
        info.pApplicationInfo = &app;
        VkInstance instance = nullptr;
        have_create = true;
        created = create(&info, nullptr, &instance);
        if (created == 0 && instance) {
            auto enumerate = reinterpret_cast<PFN_vkEnumeratePhysicalDevices>(resolve(instance, "vkEnumeratePhysicalDevices"));
            auto properties = reinterpret_cast<PFN_vkGetPhysicalDeviceProperties>(resolve(instance, "vkGetPhysicalDeviceProperties"));
            auto destroy = reinterpret_cast<PFN_vkDestroyInstance>(resolve(instance, "vkDestroyInstance"));
            int32_t r = enumerate ? enumerate(instance, &count, nullptr) : 0;
            if (enumerate && r != 0) lib.problems.push_back("vkEnumeratePhysicalDevices returned " + std::to_string(r));
            have_count = enumerate && r == 0;
            std::vector<VkPhysicalDevice> handles(MAX_DRIVER_DEVICES, nullptr);
            uint32_t got = have_count ? std::min<uint32_t>(count, MAX_DRIVER_DEVICES) : 0;
            if (count > (uint32_t) MAX_DRIVER_DEVICES) {
                lib.problems.push_back("vkEnumeratePhysicalDevices said " + std::to_string(count) + " devices: the first " +
                                       std::to_string(MAX_DRIVER_DEVICES) + " are listed");
            }
            if (got) {
                r = enumerate(instance, &got, handles.data());  // VK_INCOMPLETE (5): the first `got` of more
                if (r != 0 && r != 5) {
                    lib.problems.push_back("vkEnumeratePhysicalDevices returned " + std::to_string(r));
                    got = 0;
                }
                got = std::min<uint32_t>(got, MAX_DRIVER_DEVICES);
            }
            for (uint32_t i = 0; properties && i < got; i++) {
                alignas(8) unsigned char props[VK_PROPERTIES_SIZE];
                std::memset(props, 0, sizeof props);
                if (!handles[i]) continue;
                properties(handles[i], props);
                uint32_t api = 0, vendor = 0;
                int32_t type = 0;
                std::memcpy(&api, props + VK_API_VERSION, 4);
                std::memcpy(&vendor, props + VK_VENDOR_ID, 4);
                std::memcpy(&type, props + VK_DEVICE_TYPE, 4);
                std::string name = utf8(reinterpret_cast<const char *>(props + VK_DEVICE_NAME), 256);
                std::string version = std::to_string(api >> 22 & 0x7f) + "." + std::to_string(api >> 12 & 0x3ff) + "." +
                                      std::to_string(api & 0xfff);
                devices += devices.empty() ? "\n        {" : ",\n        {";
                devices += "\"index\": " + std::to_string(i) + ", \"name\": " + (name.empty() ? std::string("null") : json_str(name));
                devices += ", \"type\": " + json_str(type >= 0 && type <= 4 ? VK_DEVICE_TYPES[type] : "other");
                devices += ", \"api_version\": " + json_str(version) + ", \"vendor_id\": " + std::to_string(vendor) + "}";
            }
            if (destroy) destroy(instance, nullptr);
        } else if (created == 0) {
            lib.problems.push_back("vkCreateInstance returned VK_SUCCESS without an instance");
        }
    }

    std::string out = "{\n      " + lib.json_head();
    out += ",\n      \"create_instance\": " + json_int(have_create, created);
    out += ", \"device_count\": " + json_int(have_count, count);
    out += ",\n      \"devices\": [" + devices + (devices.empty() ? "]" : "\n      ]");
    out += ",\n      \"problems\": " + json_list(lib.problems) + "\n    }";
    return out;
}

// --rpc: the RPC servers an app configured (runtime/rpc_servers.py asks them the same way, in Python)

const int RPC_CMD_HELLO = 14, RPC_CMD_DEVICE_COUNT = 15;  // ggml-rpc.cpp at the pinned commit
const size_t RPC_CAPS_SIZE = 24;                            // HELLO's request: the transport's capabilities, none
const int RPC_PROTO_MAJOR = 7, RPC_PROTO_MINOR = 0;         // RPC_PROTO_*_VERSION: what the bundle's client speaks
const uint32_t RPC_MAX_DEVICES = 256;                       // more is not believed to be ggml's
const int RPC_TIMEOUT_MS = 3000;                            // each server: connection and answers together

struct RpcServer {
    std::string endpoint, reason, detail, version;  // version: "" until it answered HELLO
    uint32_t devices = 0;
    std::vector<std::string> device_names;
};

#ifdef _WIN32
using sock_t = SOCKET;
const sock_t NO_SOCKET = INVALID_SOCKET;
void close_socket(sock_t s) { closesocket(s); }
std::string socket_error() { return system_message(WSAGetLastError()); }
#else
using sock_t = int;
const sock_t NO_SOCKET = -1;
void close_socket(sock_t s) { close(s); }
std::string socket_error() { return std::strerror(errno); }
#endif

// HOST:PORT (an IPv6 host in brackets) as ggml parses it; false when it is not one
bool split_endpoint(const std::string & endpoint, std::string & host, std::string & port) {
    std::string e = trim(endpoint);
    size_t colon = e.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == e.size()) return false;
    host = e.substr(0, colon);
    port = e.substr(colon + 1);
    if (port.size() > 5 || !std::all_of(port.begin(), port.end(), [](unsigned char c) { return std::isdigit(c); })) return false;
    long n = std::strtol(port.c_str(), nullptr, 10);
    if (n <= 0 || n > 65535) return false;
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    return !host.empty() && std::none_of(host.begin(), host.end(), [](unsigned char c) { return std::isspace(c); });
}

// A TCP connection within the timeout, to the first address of `host` that takes one; "" and the socket, or why not
std::string rpc_connect(const std::string & host, const std::string & port, sock_t & out) {
    addrinfo hints{}, * found = nullptr;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &found);
    if (rc != 0) {
#ifdef _WIN32
        return system_message(rc);
#else
        return gai_strerror(rc);
#endif
    }
    std::string why = "no address";
    for (addrinfo * a = found; a; a = a->ai_next) {
        sock_t s = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (s == NO_SOCKET) { why = socket_error(); continue; }
#ifdef _WIN32
        u_long on = 1;
        ioctlsocket(s, FIONBIO, &on);
        bool pending = connect(s, a->ai_addr, (int) a->ai_addrlen) != 0 && WSAGetLastError() == WSAEWOULDBLOCK;
        fd_set w, failed;  // Winsock signals a refused connection in the exception set, not the write set
        FD_ZERO(&w);
        FD_ZERO(&failed);
        FD_SET(s, &w);
        FD_SET(s, &failed);
        timeval tv{RPC_TIMEOUT_MS / 1000, 0};
        bool ready = !pending || select(0, nullptr, &w, &failed, &tv) > 0;
#else
        fcntl(s, F_SETFL, fcntl(s, F_GETFL) | O_NONBLOCK);
        int c = connect(s, a->ai_addr, a->ai_addrlen);
        bool pending = c != 0 && errno == EINPROGRESS;
        if (c != 0 && !pending) { why = socket_error(); close_socket(s); continue; }
        pollfd p{s, POLLOUT, 0};
        bool ready = !pending || poll(&p, 1, RPC_TIMEOUT_MS) > 0;
#endif
        int err = 0;
        socklen_t len = sizeof err;
        if (!ready) {
            why = "no connection within " + std::to_string(RPC_TIMEOUT_MS / 1000) + " s";
        } else if (getsockopt(s, SOL_SOCKET, SO_ERROR, reinterpret_cast<char *>(&err), &len) != 0 || err != 0) {
#ifdef _WIN32
            why = system_message(err);
#else
            why = std::strerror(err);
#endif
        } else {  // connected: blocking again, each read and write bounded by the timeout
#ifdef _WIN32
            u_long off = 0;
            ioctlsocket(s, FIONBIO, &off);
            DWORD ms = RPC_TIMEOUT_MS;
            setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, reinterpret_cast<const char *>(&ms), sizeof ms);
            setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, reinterpret_cast<const char *>(&ms), sizeof ms);
#else
            fcntl(s, F_SETFL, fcntl(s, F_GETFL) & ~O_NONBLOCK);
            timeval tv{RPC_TIMEOUT_MS / 1000, 0};
            setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
            setsockopt(s, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
#endif
            freeaddrinfo(found);
            out = s;
            return "";
        }
        close_socket(s);
    }
    freeaddrinfo(found);
    return why;
}

bool send_all(sock_t s, const std::vector<uint8_t> & buf) {
    size_t done = 0;
    while (done < buf.size()) {
        auto n = send(s, reinterpret_cast<const char *>(buf.data()) + done, (int) (buf.size() - done), 0);
        if (n <= 0) return false;
        done += (size_t) n;
    }
    return true;
}

// `n` bytes; "" or why not
std::string recv_all(sock_t s, uint8_t * buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        auto r = recv(s, reinterpret_cast<char *>(buf) + got, (int) (n - got), 0);
        if (r == 0) return "the connection closed after " + std::to_string(got) + " of " + std::to_string(n) + " bytes";
        if (r < 0) return socket_error();
        got += (size_t) r;
    }
    return "";
}

// One request (command byte, little-endian 64-bit size, payload) and its answer, which must be `size` bytes
std::string rpc_command(sock_t s, int cmd, size_t payload, std::vector<uint8_t> & answer, size_t size) {
    std::vector<uint8_t> req(1 + 8 + payload, 0);
    req[0] = (uint8_t) cmd;
    for (int i = 0; i < 8; i++) req[1 + i] = (uint8_t) ((uint64_t) payload >> (8 * i));
    if (!send_all(s, req)) return socket_error();
    uint8_t head[8];
    std::string why = recv_all(s, head, 8);
    if (!why.empty()) return why;
    uint64_t got = 0;
    for (int i = 7; i >= 0; i--) got = (got << 8) | head[i];
    if (got != size) return "an answer of " + std::to_string(got) + " bytes where " + std::to_string(size) + " were expected";
    answer.assign(size, 0);
    return recv_all(s, answer.data(), size);
}

RpcServer rpc_check(const std::string & endpoint) {
    RpcServer r;
    r.endpoint = endpoint;
    std::string host, port;
    if (!split_endpoint(endpoint, host, port)) {
        r.reason = "rpc_endpoint_invalid", r.detail = "not HOST:PORT";
        return r;
    }
    sock_t s = NO_SOCKET;
    std::string why = rpc_connect(host, port, s);
    if (!why.empty()) {
        r.reason = "rpc_unreachable", r.detail = why;
        return r;
    }
    std::vector<uint8_t> hello, count;
    why = rpc_command(s, RPC_CMD_HELLO, RPC_CAPS_SIZE, hello, 4 + RPC_CAPS_SIZE);
    if (!why.empty()) {
        close_socket(s);
        r.reason = "rpc_not_rpc", r.detail = "no ggml RPC answer to HELLO: " + why;
        return r;
    }
    r.version = std::to_string(hello[0]) + "." + std::to_string(hello[1]) + "." + std::to_string(hello[2]);
    if (hello[0] != RPC_PROTO_MAJOR || hello[1] > RPC_PROTO_MINOR) {
        close_socket(s);
        r.reason = "rpc_version_mismatch";
        r.detail = "the server speaks " + r.version + ", the bundle " + std::to_string(RPC_PROTO_MAJOR) + "." +
                   std::to_string(RPC_PROTO_MINOR) + ".0";
        return r;
    }
    why = rpc_command(s, RPC_CMD_DEVICE_COUNT, 0, count, 4);
    close_socket(s);
    if (!why.empty()) {
        r.reason = "rpc_not_rpc", r.detail = "no answer to DEVICE_COUNT: " + why;
        return r;
    }
    r.devices = (uint32_t) count[0] | (uint32_t) count[1] << 8 | (uint32_t) count[2] << 16 | (uint32_t) count[3] << 24;
    if (r.devices == 0) {
        r.reason = "rpc_no_devices", r.detail = "it serves no device";
    } else if (r.devices > RPC_MAX_DEVICES) {
        r.reason = "rpc_not_rpc", r.detail = "it claims " + std::to_string(r.devices) + " devices", r.devices = 0;
    } else {
        r.reason = "rpc_ok";
    }
    return r;
}

// Each server in order; those that answered are added to ggml (as llama-server --rpc does) with the names ggml
// gives their devices. Without the RPC backend loaded: each one rpc_backend_missing.
std::vector<RpcServer> rpc_servers(const std::vector<std::string> & endpoints) {
    std::vector<RpcServer> out;
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    using add_server_t = ggml_backend_reg_t (*)(const char *);
    auto add_server = rpc ? reinterpret_cast<add_server_t>(ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server"))
                          : nullptr;
#ifdef _WIN32
    WSADATA wsa;
    bool winsock = add_server && WSAStartup(MAKEWORD(2, 2), &wsa) == 0;
#endif
    for (const auto & e : endpoints) {
        if (!add_server) {
            RpcServer r;
            r.endpoint = e, r.reason = "rpc_backend_missing";
            r.detail = rpc ? "the RPC backend has no ggml_backend_rpc_add_server" : "the bundle's ggml-rpc module did not load";
            out.push_back(r);
            continue;
        }
        RpcServer r = rpc_check(e);
        if (r.reason == "rpc_ok") {
            ggml_backend_reg_t reg = add_server(trim(e).c_str());
            if (reg) {
                ggml_backend_register(reg);
                for (size_t i = 0; i < ggml_backend_reg_dev_count(reg); i++) {
                    r.device_names.push_back(ggml_backend_dev_name(ggml_backend_reg_dev_get(reg, i)));
                }
            }
        }
        out.push_back(r);
    }
#ifdef _WIN32
    if (winsock) WSACleanup();
#endif
    return out;
}

std::string rpc_json(const std::vector<RpcServer> & servers) {
    std::string out = "  \"rpc_servers\": [";
    for (size_t i = 0; i < servers.size(); i++) {
        const RpcServer & r = servers[i];
        out += i ? ",\n    {" : "\n    {";
        out += "\"endpoint\": " + json_str(r.endpoint) + ", \"reason\": " + json_str(r.reason);
        out += ", \"detail\": " + json_str(r.detail);
        out += ", \"version\": " + (r.version.empty() ? std::string("null") : json_str(r.version));
        out += ", \"devices\": " + std::to_string(r.devices) + ", \"device_names\": [";
        for (size_t j = 0; j < r.device_names.size(); j++) out += (j ? ", " : "") + json_str(r.device_names[j]);
        out += "]}";
    }
    return out + (servers.empty() ? "],\n" : "\n  ],\n");
}

// `--drivers`: one JSON object, {"schema": 1, "program": …, "mode": "drivers", "drivers": {"cuda": …, "vulkan": …}}
int drivers_main() {
    std::string cuda, vulkan;
    {
        StdoutToStderr quiet;
        cuda = cuda_driver();
        vulkan = vulkan_driver();
    }
    std::string out = "{\n  \"schema\": 1,\n  \"program\": \"llamabundle-probe\",\n  \"mode\": \"drivers\",\n";
    out += "  \"drivers\": {\n    \"cuda\": " + cuda + ",\n    \"vulkan\": " + vulkan + "\n  }\n}\n";
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fflush(stdout);
    // no exit handlers or library destructors: a driver that crashes as the process ends cannot turn the
    // answer printed into a failure
    std::_Exit(0);
}

}  // namespace

int main(int argc, char ** argv) {
    const char * usage = "usage: llamabundle-probe [--dir DIR] [--rpc HOST:PORT[,...]] | --drivers";
    fs::path dir;
    bool has_dir = false, drivers = false, has_rpc = false;
    std::vector<std::string> rpc;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (((a == "--dir" || a == "--rpc") && i + 1 < argc && drivers) || (a == "--drivers" && (has_dir || has_rpc))) {
            std::fprintf(stderr, "llamabundle-probe: --drivers goes with neither --dir nor --rpc (%s)\n", usage);
            return 2;
        } else if (a == "--rpc" && i + 1 < argc) {
            has_rpc = true;
            std::string list = argv[++i];
            for (size_t at = 0; at <= list.size();) {
                size_t comma = list.find(',', at);
                if (comma == std::string::npos) comma = list.size();
                if (comma > at) rpc.push_back(list.substr(at, comma - at));
                at = comma + 1;
            }
        } else if (a == "--dir" && i + 1 < argc) {
            dir = fs::u8path(argv[++i]);
            has_dir = true;
        } else if (a == "--drivers") {
            drivers = true;
        } else if (a == "--help" || a == "-h") {
            std::printf("%s\n"
                        "Prints one JSON object: the ggml backend modules of DIR (default: this program's\n"
                        "directory), whether each loads here and why not, and the devices they find.\n"
                        "--rpc: also each RPC server named (HOST:PORT, comma-separated), asked as ggml's client\n"
                        "asks, with a reason code; the devices of those that answered are listed (RPC0, ...).\n"
                        "--drivers: the GPU drivers of this machine instead, asked without any ggml backend\n"
                        "module: the NVIDIA driver (%s) and the Vulkan loader (%s), whether\n"
                        "each opens here and why not, and the devices they find.\n",
                        usage, CUDA_LIBRARY, VULKAN_LIBRARY);
            return 0;
        } else {
            std::fprintf(stderr, "llamabundle-probe: unknown argument '%s' (%s)\n", argv[i], usage);
            return 2;
        }
    }
    if (drivers) return drivers_main();
    if (dir.empty()) dir = executable_dir();

    Log log;
    ggml_log_set(on_log, &log);

    std::vector<Module> modules;
    std::error_code ec;
    std::vector<fs::path> files;
    for (fs::directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec), end; !ec && it != end;
         it.increment(ec)) {
        if (it->is_regular_file(ec)) files.push_back(it->path());
    }
    std::sort(files.begin(), files.end());

    for (const char * name : BACKENDS) {
        const std::string variant_prefix = std::string(PREFIX) + name + "-";
        const std::string plain = std::string(PREFIX) + name + EXT;
        std::vector<size_t> mine;
        for (const auto & p : files) {
            std::string f = path_str(p.filename());
            bool variant = f.rfind(variant_prefix, 0) == 0 && p.extension() == EXT;
            if (!variant && f != plain) continue;
            Module m;
            m.file = f;
            m.backend = name;
            m.variant = variant ? f.substr(variant_prefix.size(), f.size() - variant_prefix.size() - std::strlen(EXT)) : "";
            void * h = open_module(p, m.error);
            if (h) {
                m.opened = true;
                using score_t = int (*)();
                auto score = reinterpret_cast<score_t>(symbol(h, "ggml_backend_score"));
                if (score) {
                    m.has_score = true;
                    m.score = score();
                }
                close_module(h);
            }
            mine.push_back(modules.size());
            modules.push_back(std::move(m));
        }
        // ggml's choice: the variant of highest score above 0; else the plain module
        Module * best = nullptr;
        for (size_t i : mine) {
            Module & m = modules[i];
            if (!m.variant.empty() && m.opened && m.has_score && m.score > 0 && (!best || m.score > best->score)) best = &m;
        }
        if (!best) {
            for (size_t i : mine) {
                if (modules[i].variant.empty()) best = &modules[i];
            }
        }
        for (size_t i : mine) {
            Module & m = modules[i];
            if (!m.opened) m.outcome = "not_opened";
            else if (m.has_score && m.score == 0) m.outcome = "unsupported";
            else if (!m.variant.empty() && !m.has_score) m.outcome = "no_score";
            else m.outcome = "not_chosen";
        }
        if (best && best->opened) {
            best->chosen = true;
            size_t before = log.lines.size();
            ggml_backend_reg_t reg = ggml_backend_load(path_str(dir / fs::u8path(best->file)).c_str());
            for (size_t i = before; i < log.lines.size(); i++) best->log.push_back(log.lines[i].second);
            if (reg) {
                best->loaded = true;
                best->outcome = "loaded";
                best->registered = ggml_backend_reg_name(reg);
            } else if (best->outcome == "not_chosen") {
                best->outcome = "refused";  // ggml's own checks (its log says which)
            }
        }
    }

    std::vector<RpcServer> servers;
    if (has_rpc) servers = rpc_servers(rpc);

    std::string out = "{\n  \"schema\": 1,\n  \"program\": \"llamabundle-probe\",\n";
    out += "  \"dir\": " + json_str(path_str(dir)) + ",\n";
    out += "  \"modules\": [";
    for (size_t i = 0; i < modules.size(); i++) {
        const Module & m = modules[i];
        out += i ? ",\n    {" : "\n    {";
        out += "\"file\": " + json_str(m.file) + ", \"backend\": " + json_str(m.backend);
        out += ", \"variant\": " + (m.variant.empty() ? std::string("null") : json_str(m.variant));
        out += ", \"opened\": " + std::string(m.opened ? "true" : "false");
        out += ", \"error\": " + (m.opened ? std::string("null") : json_str(m.error));
        out += ", \"score\": " + (m.has_score ? std::to_string(m.score) : std::string("null"));
        out += ", \"chosen\": " + std::string(m.chosen ? "true" : "false");
        out += ", \"loaded\": " + std::string(m.loaded ? "true" : "false");
        out += ", \"outcome\": " + json_str(m.outcome);
        out += ", \"registered\": " + (m.registered.empty() ? std::string("null") : json_str(m.registered));
        out += ", \"log\": [";
        for (size_t j = 0; j < m.log.size(); j++) out += (j ? ", " : "") + json_str(m.log[j]);
        out += "]}";
    }
    out += modules.empty() ? "],\n" : "\n  ],\n";
    if (has_rpc) out += rpc_json(servers);

    out += "  \"devices\": [";
    size_t n = ggml_backend_dev_count();
    for (size_t i = 0; i < n; i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        ggml_backend_dev_props props{};
        ggml_backend_dev_get_props(dev, &props);
        ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
        out += i ? ",\n    {" : "\n    {";
        out += "\"name\": " + json_opt(props.name) + ", \"description\": " + json_opt(props.description);
        out += ", \"backend\": " + json_opt(reg ? ggml_backend_reg_name(reg) : nullptr);
        out += ", \"type\": " + json_str(type_name(props.type));
        out += ", \"memory_total\": " + std::to_string(props.memory_total) + ", \"memory_free\": " + std::to_string(props.memory_free);
        out += ", \"device_id\": " + json_opt(props.device_id);
        std::string cc;
        const std::string name = props.name ? props.name : "";
        if (reg && std::strcmp(ggml_backend_reg_name(reg), "CUDA") == 0 && name.rfind("CUDA", 0) == 0 && name.size() > 4) {
            cc = compute_capability(log, std::strtoul(name.c_str() + 4, nullptr, 10));
        }
        out += ", \"compute_capability\": " + (cc.empty() ? std::string("null") : json_str(cc));
        out += "}";
    }
    out += n ? "\n  ],\n" : "],\n";

    out += "  \"log\": [";
    for (size_t i = 0; i < log.lines.size(); i++) {
        out += (i ? ",\n    " : "\n    ") + std::string("{\"level\": ") + json_str(log.lines[i].first) +
               ", \"text\": " + json_str(log.lines[i].second) + "}";
    }
    out += log.lines.empty() ? "]\n}\n" : "\n  ]\n}\n";
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fflush(stdout);
    return 0;
}
