; Carve for Windows: an Inno Setup 6 definition. Build it on Windows with
;     iscc installer\carve.iss
; It has never been built or run: the project's machines have neither Windows nor Inno Setup
; (installer/README.md says what is untried).
;
; The installer copies Carve's source for this user (no administrator rights), makes a Python
; virtual environment beside it with the Python launcher (`py`, Python 3.11 or newer from
; python.org), pip-installs Carve with the demo model into it, and adds a Start-menu entry.
; Uninstalling removes the program folder, the environment included.

#define AppName "Carve"
#define AppVersion "0.1.0"

[Setup]
AppId={{6F1D3C52-7A44-4D0B-9E0A-3C2B8E5A1F07}
AppName={#AppName}
AppVersion={#AppVersion}
AppPublisher=Carve
DefaultDirName={localappdata}\Programs\Carve
DefaultGroupName=Carve
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
OutputDir=..\dist
OutputBaseFilename=carve-setup-{#AppVersion}
Compression=lzma2
SolidCompression=yes
WizardStyle=modern

[Files]
Source: "..\pyproject.toml"; DestDir: "{app}\src"
Source: "..\README.md"; DestDir: "{app}\src"
Source: "..\app\*"; DestDir: "{app}\src\app"; Excludes: "__pycache__"; Flags: recursesubdirs
Source: "..\engine\*"; DestDir: "{app}\src\engine"; Excludes: "__pycache__"; Flags: recursesubdirs
Source: "..\kernels\*"; DestDir: "{app}\src\kernels"; Excludes: "__pycache__"; Flags: recursesubdirs
Source: "..\spec\*"; DestDir: "{app}\src\spec"; Excludes: "__pycache__"; Flags: recursesubdirs

[Run]
; torch comes from pip's defaults (on Windows its CPU build: installer/README.md says how to
; swap in the CUDA build afterwards)
Filename: "{cmd}"; Parameters: "/c py -3 -m venv ""{app}\venv"" && ""{app}\venv\Scripts\python.exe"" -m pip install --upgrade ""{app}\src[demo]"""; StatusMsg: "Installing Carve and torch into its own Python environment (several minutes)..."; Flags: runhidden waituntilterminated

[Icons]
Name: "{group}\Carve"; Filename: "{app}\venv\Scripts\pythonw.exe"; Parameters: "-m app"; WorkingDir: "{app}"; Comment: "Plan, launch and chat with large GGUF models"
Name: "{group}\Uninstall Carve"; Filename: "{uninstallexe}"

[UninstallDelete]
Type: filesandordirs; Name: "{app}\venv"
Type: filesandordirs; Name: "{app}\src"

[Code]
function InitializeSetup(): Boolean;
var
  Code: Integer;
begin
  Result := Exec(ExpandConstant('{cmd}'),
    '/c py -3 -c "import sys; sys.exit(sys.version_info < (3, 11))"', '', SW_HIDE,
    ewWaitUntilTerminated, Code) and (Code = 0);
  if not Result then
    MsgBox('Carve needs Python 3.11 or newer with the Python launcher (py). Install it from ' +
      'python.org, then run this installer again.', mbError, MB_OK);
end;
