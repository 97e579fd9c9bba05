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
#    include <windows.h>
#    include <fstream>
#else
#    include <dlfcn.h>
#    include <unistd.h>
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

}  // namespace

int main(int argc, char ** argv) {
    fs::path dir;
    for (int i = 1; i < argc; i++) {
        std::string a = argv[i];
        if (a == "--dir" && i + 1 < argc) {
            dir = fs::u8path(argv[++i]);
        } else if (a == "--help" || a == "-h") {
            std::printf("usage: llamabundle-probe [--dir DIR]\n"
                        "Prints one JSON object: the ggml backend modules of DIR (default: this program's\n"
                        "directory), whether each loads here and why not, and the devices they find.\n");
            return 0;
        } else {
            std::fprintf(stderr, "llamabundle-probe: unknown argument '%s' (usage: llamabundle-probe [--dir DIR])\n", argv[i]);
            return 2;
        }
    }
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
